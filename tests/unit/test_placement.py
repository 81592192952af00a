"""place(): one epoch's plan, rank order, transfers and prediction, checked against facts
the placement does not compute itself: the model's dimensions, what each node's rank reads
(rank_boxes, proven equal to the loader's reads in test_weights_boxes.py) and what each node
already holds."""

from __future__ import annotations

import pytest
from lab_profiles import lab_profile
from weights_synthetic import llama_spec, synthetic_manifest

from exo_tp.node.leader.placement import Holdings, Member, Members, place, planner_cluster
from exo_tp.plan import plan_tensor_parallel
from exo_tp.plan.cluster import Reads, model_read_speed
from exo_tp.plan.matvec import MatvecTable
from exo_tp.plan.pipeline import single_stage
from exo_tp.plan.predict import predict
from exo_tp.plan.search import choose_plan
from exo_tp.weights.boxes import Boxes, rank_boxes, whole
from exo_tp.weights.transfer import Holding, TransferError
from exo_tp.wire.profiles import ProfileSummary, ShapeSeconds

SPEC = llama_spec(6, 3, 64, 128, 192, 256, 2, True, None)


def summary(speed: float, shapes: tuple[ShapeSeconds, ...] = ()) -> ProfileSummary:
    """A profiled device reading weights at ``speed`` bytes/s (and ``shapes`` measured)."""
    return ProfileSummary(
        chip="test",
        cores=1,
        mlx_version="0",
        mlx_device="cpu",
        memory_total=16 * 10**9,
        memory_available=8 * 10**9,
        backends=("ring",),
        memory_bandwidth=1e10,
        decode_seconds_per_byte=1.0 / speed,
        prefill_flops=2e10,
        shapes=shapes,
    )


def members(*weights: float, measured: bool = False, stages: tuple[int, ...] = ()) -> Members:
    return Members(
        members=tuple(
            Member(
                node_id=n,
                weight=w,
                profile=summary(w) if measured else None,
                memory_available=8 * 10**9,
            )
            for n, w in zip("abcdefgh", weights, strict=False)
        ),
        measured=measured,
        stages=stages,
    )


def test_shares_sum_to_the_models_dimensions() -> None:
    placed = place(SPEC, members(3, 2, 1), Holdings(files=frozenset("abc")))
    (stage,) = placed.plan.stages
    ranks = stage.tp.ranks
    assert placed.rank_order == ("a", "b", "c") and placed.transfers is None
    assert placed.prediction is None  # shares set by hand (not measured): no search
    for dim, size in (("q_heads", SPEC.num_heads), ("ffn", 192), ("vocab", SPEC.vocab_size)):
        spans = [r.span(dim) for r in ranks]
        assert spans[0].start == 0 and spans[-1].stop >= size, dim
        assert all(x.stop == y.start for x, y in zip(spans, spans[1:], strict=False)), dim
    assert stage.layers.start == 0 and stage.layers.stop == SPEC.num_layers
    # heavier nodes get no fewer rows
    rows = [r.span("ffn").stop - r.span("ffn").start for r in ranks]
    assert rows == sorted(rows, reverse=True)


def test_forced_stages_plan_as_told() -> None:
    placed = place(SPEC, members(1, 1, 1, stages=(2, 1)), Holdings(files=frozenset("abc")))
    assert [len(s.ranks) for s in placed.plan.stages] == [2, 1]
    layers = [s.layers for s in placed.plan.stages]
    assert layers[0].start == 0 and layers[0].stop == layers[1].start
    assert layers[1].stop == SPEC.num_layers
    assert placed.rank_order == ("a", "b", "c")


def test_a_model_without_a_table_gets_a_node_per_stage_or_the_heaviest_node() -> None:
    """Shares set by hand for mlx-lm models no table splits: starcoder2's layers go to one
    node per stage by weight (a node of weight 0 left out); gemma runs whole on the heaviest."""
    starcoder = SPEC.model_copy(update={"model_type": "starcoder2", "num_layers": 6})
    placed = place(starcoder, members(3, 0, 1), Holdings(files=frozenset("abc")))
    assert placed.rank_order == ("a", "c") and [s.size for s in placed.plan.stages] == [1, 1]
    layers = [s.layers.size for s in placed.plan.stages]
    assert sum(layers) == 6 and layers[0] > layers[1]
    assert placed.notes and "no tensor-parallel table for starcoder2" in placed.notes[0]
    gemma = SPEC.model_copy(update={"model_type": "gemma"})
    placed = place(gemma, members(1, 3, 2), Holdings(files=frozenset("abc")))
    assert placed.rank_order == ("b",) and len(placed.plan.stages) == 1
    assert placed.plan.stages[0].size == 1


def test_measured_speeds_leave_a_slow_node_out() -> None:
    """Twenty times slower than the others: the planner's prediction says it costs more than it
    brings, so the epoch runs on the two fast nodes (as tests/cluster/test_node_planner.py runs
    it)."""
    spec = llama_spec(9, 3, 64, 576, 1536, 49152, 30, True, None)  # smollm2-135m's shape
    cluster = members(3e9, 3e9, 0.15e9, measured=True)
    placed = place(spec, cluster, Holdings(files=frozenset("abc")))
    assert sorted(placed.rank_order) == ["a", "b"]
    assert placed.prediction is not None and placed.prediction.tokens_per_second > 0
    assert placed.plan.stages[0].tp.weights == pytest.approx([0.5, 0.5])
    assert placed.notes and "planner:" in placed.notes[0]


def test_holders_keep_their_rows_and_newcomers_fetch_the_rest() -> None:
    """``a`` has the files; ``b`` kept the second half of a two-node epoch in its store; ``c``
    is new and listed first. The rank order puts ``b`` after ``a`` (where its rows still are);
    every node's retained bytes are what it held of its share, and the rest is fetched."""
    manifest = synthetic_manifest(SPEC, None)
    old = single_stage(plan_tensor_parallel(SPEC, [1, 1]))
    held = (
        Holding(node="a", files=True, extras=True),
        Holding(node="b", store=rank_boxes(manifest, old, 1)),
        Holding(node="c"),
    )
    cluster = Members(members=tuple(Member(node_id=n, weight=1.0) for n in "cab"), measured=False)
    placed = place(SPEC, cluster, Holdings(files=frozenset("a"), manifest=manifest, held=held))
    order = placed.rank_order
    assert sorted(order) == ["a", "b", "c"] and order.index("a") < order.index("b")
    transfers = placed.transfers
    assert transfers is not None and transfers.order == order
    holding = {h.node: h for h in held}
    for rank, node in enumerate(order):
        share = rank_boxes(manifest, placed.plan, rank)
        mine = whole(manifest) if holding[node].files else holding[node].store
        part = transfers.node(node)
        assert part.share == share
        assert part.retained == share.meet(mine)
        fetched = Boxes()
        for fetch in part.fetches:
            fetched = fetched.union(Boxes.of([(fetch.tensor, [(fetch.start, fetch.stop)])]))
        assert fetched.union(part.retained) == share, node  # each byte once: held or fetched
        assert not fetched.meet(part.retained).ranges, node
    assert transfers.node("b").retained.nbytes(manifest) > 0


def test_a_missing_manifest_is_a_clear_error() -> None:
    with pytest.raises(TransferError, match="c lack the files"):
        place(SPEC, members(1, 1, 1), Holdings(files=frozenset("ab")))


def test_a_rank_slowed_while_serving_is_priced_by_its_shapes_that_much_slower() -> None:
    """After a rebalance the leader prices a node at its live speed, its measured shapes
    scaled by profiled over live speed: every plan's weight reads then take that much longer
    on it (the shapes, and the norms priced per byte), and the faster node gets more rows."""
    table = MatvecTable.of(
        [(64, n, 64 * n * 4e-10 * (1 + n / 512)) for n in range(8, 257, 8)]
        + [(k, 64, 64 * k * 4e-10) for k in range(8, 257, 8) if k != 64]
    )
    whole_model = model_read_speed(SPEC, Reads(seconds_per_byte=4e-10, matvec=table))

    shapes = tuple(
        ShapeSeconds(dtype="float32", k=x.k, n=x.n, seconds=x.seconds) for x in table.points
    )

    def cluster(factor: float) -> Members:
        member = Member(
            node_id="a",
            weight=whole_model / factor,
            profile=summary(1 / 4e-10, shapes),
            slowdown=factor,
            memory_available=8 * 10**9,
        )
        return Members(members=(member,), measured=True)

    plan = single_stage(plan_tensor_parallel(SPEC, [1.0]))
    seconds = [
        predict(plan, [0], planner_cluster(SPEC, cluster(f))).stages[0].compute_seconds
        for f in (1.0, 2.5)
    ]
    assert seconds[1] == pytest.approx(2.5 * seconds[0])
    # beside an unslowed twin, the slowed node's share follows the live speeds
    both = Members(
        members=(
            cluster(1.0).members[0].model_copy(update={"node_id": "b"}),
            cluster(2.5).members[0],
        ),
        measured=True,
    )
    choice = choose_plan(SPEC, planner_cluster(SPEC, both))
    tp = next(c for c in (choice.best, *choice.alternatives) if c.kind == "tensor parallel")
    names = [both.members[d].node_id for d in tp.devices]
    shares = dict(zip(names, tp.plan.stages[0].tp.weights, strict=True))
    assert shares["b"] / shares["a"] == pytest.approx(2.5, rel=0.1)


def test_the_leader_plans_over_the_cluster_exo_tp_plan_previews() -> None:
    """What a node tells the leader of its profile (its summary, through JSON as a status
    carries it) prices the same devices and links as the profile file `exo-tp plan` reads: the
    same cluster, the same choice. The link between the first two is slow, and decides it."""
    from exo_tp.plan.cluster import cluster_from_profiles
    from exo_tp.plan.devices import MatmulScore
    from exo_tp.plan.render_choice import render_choice
    from exo_tp.wire.profiles import LinkProfile

    spec = llama_spec(9, 3, 64, 576, 1536, 49152, 30, True, None)
    slow = LinkProfile(
        a="0@x",
        b="1@y",
        up=True,
        all_sum_latency=5e-3,
        all_sum_bandwidth=1e7,
        measured_at="2026-12-01T21:00:00+00:00",
    )
    kernel = MatmulScore(
        kind="matvec", dtype="float32", m=1, k=576, n=1536, seconds=1e-3, flops=1.0,
        weight_bytes_per_second=1e9,
    )  # fmt: skip
    profiles = [
        lab_profile(1.0, node_id=f"{i}@{host}", kernels=(kernel,), links=(slow,) if i == 0 else ())
        for i, host in enumerate("xyz")
    ]
    preview = cluster_from_profiles(spec, profiles, names=["a", "b", "c"])
    told = [ProfileSummary.model_validate_json(p.summary().model_dump_json()) for p in profiles]
    members = Members(
        members=tuple(
            Member(node_id=n, weight=1.0, profile=s) for n, s in zip("abc", told, strict=True)
        ),
        measured=True,
    )
    leader = planner_cluster(spec, members)
    assert leader == preview
    assert leader.link(0, 1).latency == 5e-3 and not leader.link(0, 2).measured
    assert choose_plan(spec, leader) == choose_plan(spec, preview)
    assert set(choose_plan(spec, leader).best.devices) != {0, 1, 2}  # not over the slow link
    # what exo-tp plan prints of them: each pair measured (how, when) or assumed
    text = render_choice(choose_plan(spec, preview), preview)
    assert "a - b: all_sum 5 ms at 4 KB" in text, text
    assert "measured (bench 2026-12-01T21:00:00+00:00)" in text
    assert "a - c: all_sum 200 µs at 4 KB, 1 GB/s; assumed (not measured)" in text
