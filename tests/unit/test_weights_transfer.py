"""Transfer planning properties (pure; hypothesis over llama-shaped models, plans and holdings).

The reference for "what a node needs" is rank_boxes, itself proven equal to the loader's reads
in test_weights_boxes.py; here the planner's output is checked against set arithmetic on it.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from weights_synthetic import llama_spec, synthetic_manifest

from exo_tp.plan import plan_tensor_parallel
from exo_tp.plan.pipeline import PipelinePlan, plan_pipeline, single_stage
from exo_tp.plan.spec import ModelSpec
from exo_tp.plan.tensor_parallel import split_grains
from exo_tp.weights import ranges as R
from exo_tp.weights.boxes import Boxes, rank_boxes, whole
from exo_tp.weights.manifest import ModelManifest
from exo_tp.weights.transfer import (
    COST,
    Holding,
    TransferError,
    bytes_to_move,
    choose_rank_order,
    plan_transfer,
)

SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def models(draw: st.DrawFn) -> tuple[ModelSpec, ModelManifest]:
    quant = draw(st.sampled_from([None, (32, 4), (64, 8)]))
    kv = draw(st.integers(1, 3))
    heads = kv * draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([32, 64]))
    align = quant[0] if quant else 1
    hidden = draw(st.sampled_from([64, 128, 192]))
    ffn = align * draw(st.integers(1, 6)) if quant else draw(st.integers(20, 200))
    spec = llama_spec(
        heads,
        kv,
        head_dim,
        hidden,
        ffn,
        draw(st.integers(64, 400)),
        draw(st.integers(1, 3)),
        draw(st.booleans()),
        quant,
    )
    if quant and (heads * head_dim) % quant[0]:
        spec = spec.model_copy(update={"head_dim": 64})
    return spec, synthetic_manifest(spec, quant, sanitized_extra=draw(st.booleans()))


def weights(n: int) -> st.SearchStrategy[list[float]]:
    return st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0, 5.0]), min_size=n, max_size=n)


def plan_over(spec: ModelSpec, w: Sequence[float], stages: int) -> PipelinePlan:
    if stages == 1 or len(w) < 2 or spec.num_layers < 2:
        return single_stage(plan_tensor_parallel(spec, w))
    cut = max(1, len(w) // 2)
    return plan_pipeline(spec, [list(w[:cut]), list(w[cut:])])


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[ModelManifest, PipelinePlan, list[str], list[Holding]]:
    """An old plan whose nodes hold their shares (in stores, or files), then a new plan over
    the old nodes plus newcomers, in a shuffled order."""
    spec, manifest = draw(models())
    old_n = draw(st.integers(1, 4))
    old_plan = plan_over(spec, draw(weights(old_n)), draw(st.integers(1, 2)))
    old_nodes = [f"n{i}" for i in range(old_n)]
    holdings = []
    for rank, node in enumerate(old_nodes):
        files = draw(st.booleans()) if rank else True  # someone has the files
        store = Boxes() if files else rank_boxes(manifest, old_plan, rank)
        holdings.append(Holding(node=node, files=files, store=store))
    new_nodes = old_nodes + [f"m{i}" for i in range(draw(st.integers(0, 2)))]
    order = draw(st.permutations(new_nodes))
    new_plan = plan_over(spec, draw(weights(len(order))), draw(st.integers(1, 2)))
    return manifest, new_plan, list(order), holdings


def held(holding: Holding | None, manifest: ModelManifest) -> Boxes:
    if holding is None:
        return Boxes()
    return whole(manifest) if holding.files else holding.store


@SETTINGS
@given(scenarios())
def test_fetches_plus_retained_tile_each_share_once_from_holders(
    scenario: tuple[ModelManifest, PipelinePlan, list[str], list[Holding]],
) -> None:
    manifest, plan, order, holdings = scenario
    by_node = {h.node: h for h in holdings}
    transfer = plan_transfer(manifest, plan, order, holdings, chunk=2048)
    minimum = 0
    for rank, node in enumerate(order):
        t = transfer.node(node)
        share = rank_boxes(manifest, plan, rank)
        mine = held(by_node.get(node), manifest)
        assert t.share == share and t.rank == rank
        # exactly once: fetched pieces are disjoint from each other and from what is retained
        pieces = [*t.retained.pieces(), *((f.tensor, f.start, f.stop) for f in t.fetches)]
        for name, rs in share.ranges.items():
            mine_pieces = [(a, b) for n, a, b in pieces if n == name]
            assert sum(b - a for a, b in mine_pieces) == R.length(rs), name
            assert R.normalize(mine_pieces) == rs, name
        assert set(t.retained.ranges) | {f.tensor for f in t.fetches} <= set(share.ranges)
        # nothing fetched that is held; everything held is retained
        assert not t.fetched.meet(mine).ranges
        assert t.retained == share.meet(mine)
        for f in t.fetches:
            manifest.tensor(f.tensor).blocks(f.start, f.stop)  # whole digest blocks
            assert f.sources and all(s.node != node for s in f.sources)
            for s in f.sources:  # every listed source holds the piece, cheapest first
                has = by_node[s.node]
                assert (
                    has.files
                    if s.kind == "files"
                    else has.store.covers(Boxes.of([(f.tensor, [(f.start, f.stop)])]))
                )
            assert [COST[s.kind] for s in f.sources] == sorted(COST[s.kind] for s in f.sources)
        minimum += share.minus(mine).nbytes(manifest)
    assert transfer.moved_bytes == minimum
    assert transfer.moved_bytes == bytes_to_move(manifest, plan, order, by_node)
    assert sum(transfer.source_bytes.values()) == minimum


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(models(), st.integers(2, 4), st.data())
def test_rank_order_never_moves_more_than_the_given_order(
    model: tuple[ModelSpec, ModelManifest], old_n: int, data: st.DataObject
) -> None:
    spec, manifest = model
    speed = dict(
        zip([f"n{i}" for i in range(old_n + 1)], data.draw(weights(old_n + 1)), strict=True)
    )
    old = [f"n{i}" for i in range(old_n)]
    old_plan = single_stage(plan_tensor_parallel(spec, [speed[n] for n in old]))
    holdings = [Holding(node="n0", files=True)] + [
        Holding(node=n, store=rank_boxes(manifest, old_plan, r)) for r, n in enumerate(old) if r
    ]
    joined = data.draw(st.permutations([*old, f"n{old_n}"]))

    def plan_for(order: tuple[str, ...]) -> PipelinePlan:  # shares follow the nodes
        return single_stage(plan_tensor_parallel(spec, [speed[n] for n in order]))

    by_node = {h.node: h for h in holdings}
    order, plan = choose_rank_order(manifest, joined, plan_for, holdings)
    assert sorted(order) == sorted(joined)
    chosen = bytes_to_move(manifest, plan, order, by_node)
    assert chosen <= bytes_to_move(manifest, plan_for(tuple(joined)), joined, by_node)
    assert plan_transfer(manifest, plan, order, holdings).moved_bytes == chosen


def test_rank_order_keeps_a_node_where_its_bytes_are() -> None:
    """Three equal nodes; the newcomer placed first by the caller would shift every share: the
    chosen order puts it last, where the old stores still cover the old shares."""
    spec = llama_spec(6, 3, 64, 128, 192, 256, 2, True, None)
    manifest = synthetic_manifest(spec, None)
    old = single_stage(plan_tensor_parallel(spec, [1, 1]))
    holdings = [
        Holding(node="a", files=True),
        Holding(node="b", store=rank_boxes(manifest, old, 1)),
    ]

    def plan_for(order: tuple[str, ...]) -> PipelinePlan:
        return single_stage(plan_tensor_parallel(spec, [1] * len(order)))

    order, plan = choose_rank_order(manifest, ["c", "a", "b"], plan_for, holdings)
    by_node = {h.node: h for h in holdings}
    assert bytes_to_move(manifest, plan, order, by_node) < bytes_to_move(
        manifest, plan_for(("c", "a", "b")), ["c", "a", "b"], by_node
    )
    assert order.index("a") < order.index("b")


def test_load_spreads_over_equal_sources_and_prefers_stores() -> None:
    spec = llama_spec(6, 3, 64, 128, 192, 256, 2, False, None)
    manifest = synthetic_manifest(spec, None)
    plan = single_stage(plan_tensor_parallel(spec, [1, 1]))
    two_files = [Holding(node="a", files=True), Holding(node="b", files=True)]
    transfer = plan_transfer(manifest, plan, ["c", "d"], two_files, chunk=16 << 10)
    served = transfer.source_bytes
    assert set(served) == {"a", "b"}
    assert abs(served["a"] - served["b"]) <= max(
        manifest.tensor(f.tensor).bytes_of(((f.start, f.stop),))
        for t in transfer.nodes
        for f in t.fetches
    )
    # a peer's store before a peer's files
    store = Holding(node="s", store=rank_boxes(manifest, plan, 0))
    transfer = plan_transfer(manifest, plan, ["c", "d"], [*two_files, store])
    assert all(f.sources[0].node == "s" for f in transfer.node("c").fetches)


def test_nobody_holding_a_piece_is_a_clear_error() -> None:
    spec = llama_spec(6, 3, 64, 128, 192, 256, 2, True, None)
    manifest = synthetic_manifest(spec, None)
    plan = single_stage(plan_tensor_parallel(spec, [1, 1]))
    partial = Holding(node="a", store=rank_boxes(manifest, plan, 0))
    with pytest.raises(TransferError, match="no node holds"):
        plan_transfer(manifest, plan, ["a", "b"], [partial])


@settings(max_examples=200, deadline=None)
@given(models(), st.lists(st.floats(0.1, 10), min_size=1, max_size=12))
def test_every_plan_cuts_on_split_grains(
    model: tuple[ModelSpec, ModelManifest], w: list[float]
) -> None:
    spec, _ = model
    plan = plan_tensor_parallel(spec, w)
    grains = split_grains(spec)
    totals = {"q_heads": spec.num_heads, "vocab": spec.vocab_size, **spec.ffn_sizes}
    for r in plan.ranks:  # a span starts on a grain, or at the end (the last unit stops short)
        for dim, total in totals.items():
            start = r.span(dim).start
            assert start % grains[dim] == 0 or start == total, (dim, start)
