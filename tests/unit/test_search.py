"""The planner's search: which devices, grouped how (pure, no MLX)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exo_tp.errors import PlanError
from exo_tp.plan import ModelSpec, Quantization, plan_tensor_parallel, spec_from_config
from exo_tp.plan.cluster import Cluster, DeviceCost, Link, with_read_speed
from exo_tp.plan.cost import LinkCost
from exo_tp.plan.matvec import MatvecTable
from exo_tp.plan.pipeline import single_stage
from exo_tp.plan.predict import predict
from exo_tp.plan.search import choose_plan, resolve_objective

# An 8B-class llama in 4-bit group 64: ~4.5 GB of weights.
SPEC = ModelSpec(
    model_type="llama",
    hidden_size=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    ffn_sizes={"ffn": 14336},
    vocab_size=128256,
    tie_word_embeddings=False,
    quantization=Quantization(group_size=64, bits=4),
    context_length=8192,
)
GB = 10**9
THUNDERBOLT = LinkCost(latency=30e-6, bandwidth=8e9, measured=True)
LAN = LinkCost(latency=300e-6, bandwidth=1e9, measured=True)
SLOW = LinkCost(latency=5e-3, bandwidth=50e6, measured=True)


def device(name: str, gb_per_s: float, memory_gb: float) -> DeviceCost:
    return DeviceCost(
        name=name,
        seconds_per_byte=1 / (gb_per_s * GB),
        prefill_flops=1e12,
        memory=int(memory_gb * GB),
    )


def test_uneven_tensor_parallel_when_links_are_fast() -> None:
    cluster = Cluster(
        devices=(device("a", 100, 64), device("b", 60, 64), device("c", 30, 64)),
        default_link=THUNDERBOLT,
    )
    choice = choose_plan(SPEC, cluster, context_tokens=4096)
    assert choice.best.kind == "tensor parallel" and choice.best.groups == ((0, 1, 2),)
    assert choice.best.plan.stages[0].tp.weights == pytest.approx((100 / 190, 60 / 190, 30 / 190))
    kinds = {c.kind for c in choice.alternatives}
    assert {"single device", "pipeline"} <= kinds  # the runner-ups it beat


def test_hybrid_when_one_link_is_slow() -> None:
    # Two pairs joined by Thunderbolt, the pairs by a slow link; no pair holds the model alone.
    links = (Link(a=0, b=1, cost=THUNDERBOLT), Link(a=2, b=3, cost=THUNDERBOLT))
    cluster = Cluster(
        devices=tuple(device(n, 100, 2.2) for n in "abcd"), links=links, default_link=SLOW
    )
    choice = choose_plan(SPEC, cluster, context_tokens=4096)
    assert choice.best.kind == "hybrid"
    assert sorted(map(sorted, choice.best.groups)) == [[0, 1], [2, 3]]
    by_kind = {c.kind: c.prediction.decode_seconds for c in reversed(choice.alternatives)}
    # All four as one TP group pays the slow link twice per layer: far slower.
    assert by_kind["tensor parallel"] > 10 * choice.best.prediction.decode_seconds
    assert by_kind["pipeline"] > choice.best.prediction.decode_seconds


def test_no_stages_for_an_architecture_without_stage_support() -> None:
    """The slow-link cluster of the hybrid test, with a gemma3 model (whose sliding layers are
    picked by their index in the model a stage runs): only one-stage plans are considered."""
    links = (Link(a=0, b=1, cost=THUNDERBOLT), Link(a=2, b=3, cost=THUNDERBOLT))
    cluster = Cluster(
        devices=tuple(device(n, 100, 2.2) for n in "abcd"), links=links, default_link=SLOW
    )
    gemma = SPEC.model_copy(update={"model_type": "gemma3_text"})
    choice = choose_plan(gemma, cluster, context_tokens=4096)
    assert {len(c.groups) for c in (choice.best, *choice.alternatives)} == {1}
    assert any("no pipeline stages for gemma3_text" in r.reason for r in choice.rejected)


def test_a_model_without_a_table_gets_one_device_per_stage() -> None:
    """The fast-link cluster of the uneven-TP test, with models mlx-lm has but no table
    splits: starcoder2's layers pipeline (one device per stage, never a TP group), gemma's
    do not (it scales its embedding in the forward pass): one device holds it whole."""
    links = (Link(a=0, b=1, cost=THUNDERBOLT), Link(a=2, b=3, cost=THUNDERBOLT))
    cluster = Cluster(
        devices=tuple(device(n, 100, 2.2) for n in "abcd"), links=links, default_link=SLOW
    )
    starcoder = SPEC.model_copy(update={"model_type": "starcoder2"})
    choice = choose_plan(starcoder, cluster, context_tokens=4096)
    assert choice.best.kind == "pipeline"
    assert all(len(g) == 1 for c in (choice.best, *choice.alternatives) for g in c.groups)
    assert any("no tensor-parallel table for starcoder2" in r.reason for r in choice.rejected)
    small = SPEC.model_copy(update={"model_type": "gemma", "num_layers": 8})
    choice = choose_plan(small, cluster, context_tokens=4096)
    assert choice.best.kind == "single device"
    assert {c.kind for c in choice.alternatives} <= {"single device"}


def test_a_gated_deltanet_hybrid_plans_as_tensor_parallel_stages() -> None:
    """Qwen3-Next-80B-A3B's shape (36 Gated DeltaNet layers of 16 key heads with 2 value heads
    each, 12 full attention layers, 512 experts) in 4-bit on the slow-link pairs of the hybrid
    test with less memory: two TP stages, each rank holding key heads of its stage's linear
    layers (their state priced per stream), as for any family that pipelines."""
    config = dict(
        model_type="qwen3_next",
        hidden_size=2048,
        num_hidden_layers=48,
        intermediate_size=5120,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        vocab_size=151936,
        quantization={"group_size": 64, "bits": 4},
    )
    spec = spec_from_config(config)
    assert spec.linear_attention is not None and len(spec.linear_attention.layers) == 36
    links = (Link(a=0, b=1, cost=THUNDERBOLT), Link(a=2, b=3, cost=THUNDERBOLT))
    cluster = Cluster(
        devices=tuple(device(n, 100, 14) for n in "abcd"), links=links, default_link=SLOW
    )
    choice = choose_plan(spec, cluster, context_tokens=32768)
    assert choice.best.kind == "hybrid"
    assert sorted(map(sorted, choice.best.groups)) == [[0, 1], [2, 3]]
    for stage in choice.best.plan.stages:
        assert [r.linear_heads.size for r in stage.tp.ranks] == [8, 8]


def test_drops_a_device_twenty_times_slower() -> None:
    cluster = Cluster(
        devices=(device("a", 100, 64), device("b", 100, 64), device("c", 5, 64)), default_link=LAN
    )
    choice = choose_plan(SPEC, cluster, context_tokens=4096)
    assert choice.best.dropped == (2,) and choice.best.groups == ((0, 1),)
    everyone = next(c for c in choice.alternatives if c.groups == ((0, 1, 2),))
    assert everyone.prediction.decode_seconds > choice.best.prediction.decode_seconds


def test_layers_fill_the_fastest_stage_first_within_memory() -> None:
    # b is twice as fast as a but holds only 10 of the 32 layers (~140 MB each + KV cache).
    cluster = Cluster(devices=(device("a", 50, 64), device("b", 100, 2.0)), default_link=SLOW)
    choice = choose_plan(SPEC, cluster, context_tokens=4096)
    for candidate in (choice.best, *choice.alternatives):
        assert candidate.prediction.fits
    pipeline = next(c for c in (choice.best, *choice.alternatives) if c.kind == "pipeline")
    faster = pipeline.groups.index((1,))
    layers = [s.layers.size for s in pipeline.plan.stages]
    # b takes as many layers as fit: one more would overflow it.
    more = [n + (1 if i == faster else -1) for i, n in enumerate(layers)]
    from exo_tp.plan.search import _pipeline

    bigger = _pipeline(SPEC, [s.tp for s in pipeline.plan.stages], more)
    assert not predict(bigger, pipeline.devices, cluster, 4096).fits


def test_no_plan_fits_is_one_readable_error() -> None:
    cluster = Cluster(devices=(device("a", 100, 1), device("b", 100, 1)), default_link=LAN)
    with pytest.raises(PlanError, match="no plan fits") as error:
        choose_plan(SPEC, cluster, context_tokens=4096)
    assert "\n" not in str(error.value)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.floats(1, 200), st.floats(0.5, 12)), min_size=1, max_size=6),
    st.sampled_from([THUNDERBOLT, LAN, SLOW]),
)
def test_the_choice_fits_and_is_the_fastest_found(
    devices: list[tuple[float, float]], link: LinkCost
) -> None:
    cluster = Cluster(
        devices=tuple(device(f"d{i}", s, m) for i, (s, m) in enumerate(devices)), default_link=link
    )
    try:
        choice = choose_plan(SPEC, cluster, context_tokens=2048)
    except PlanError:
        # Only when memory really is short: the model and its KV cache on one device, plus
        # what a pipeline may leave unused on each device (less than a layer).
        whole = predict(single_stage(plan_tensor_parallel(SPEC, [1])), [0], cluster, 2048)
        need = whole.memory[0].total
        assert sum(m for _, m in devices) * GB < need + len(devices) * need / SPEC.num_layers
        return
    ranked = (choice.best, *choice.alternatives)
    times = [c.prediction.decode_seconds for c in ranked]
    assert times == sorted(times)
    for c in ranked:
        assert c.prediction.fits
        assert sorted(c.devices + c.dropped) == list(range(len(devices)))
        # The prediction is the cost model's, recomputed independently of the search.
        again = predict(c.plan, c.devices, cluster, 2048)
        assert again.decode_seconds == pytest.approx(c.prediction.decode_seconds)


def test_throughput_objective_gives_layers_by_stage_speed_under_load() -> None:
    """Two devices on a slow link, neither holding the model alone, one reading weights twice
    as fast, both with the same FLOP rate. One request at a time (weight reads bind) fills the
    fast stage first; 16 at once, overlapped, each stage's micro-batch of 8 rows is bound by
    FLOPs, equal on both, so the layers split about evenly (the last stage also holds the LM
    head) and the plan serves more tokens per
    second under load than the latency plan would."""
    cluster = Cluster(devices=(device("fast", 100, 4), device("slow", 50, 4)), default_link=SLOW)
    latency = choose_plan(SPEC, cluster, context_tokens=2048, objective="latency")
    loaded = choose_plan(SPEC, cluster, context_tokens=2048, objective="throughput")
    assert latency.best.kind == loaded.best.kind == "pipeline"
    assert [s.layers.size for s in latency.best.plan.stages] == [23, 9]  # fast stage full
    assert [s.layers.size for s in loaded.best.plan.stages] == [17, 15]  # + the head on 1
    assert loaded.objective == "throughput" and loaded.streams == 16
    as_loaded = latency.best.prediction.model_copy(update={"streams": 16})
    assert loaded.best.prediction.loaded_tokens_per_second > as_loaded.loaded_tokens_per_second
    # One stream: the loaded figure is the single-request rate (nothing to overlap).
    one = latency.best.prediction
    assert one.loaded_tokens_per_second == pytest.approx(one.tokens_per_second)


@pytest.mark.parametrize(
    ("requested", "queue", "objective", "streams"),
    [
        ("auto", 0, "latency", 1),
        ("auto", 1, "latency", 1),
        ("auto", 5, "throughput", 5),
        ("latency", 40, "latency", 1),
        ("throughput", 0, "throughput", 16),
        ("throughput", 40, "throughput", 40),
    ],
)
def test_auto_objective_follows_the_observed_queue(
    requested: str, queue: int, objective: str, streams: int
) -> None:
    chosen, priced, reason = resolve_objective(requested, queue)  # type: ignore[arg-type]
    assert (chosen, priced) == (objective, streams)
    assert reason.startswith(requested)  # the explanation says what was asked
    choice = choose_plan(
        SPEC,
        Cluster(devices=(device("a", 100, 64),), default_link=THUNDERBOLT),
        context_tokens=2048,
        objective=requested,  # type: ignore[arg-type]
        queue=queue,
    )
    assert (choice.objective, choice.streams, choice.reason) == (objective, streams, reason)


def test_shares_balance_what_each_device_reads_its_own_shard_at() -> None:
    """Two devices reading every byte at 1 ns, except that device a reads a down_proj of more
    than 512 rows at 3 ns a byte (a step, as OpenBLAS has one). Over the whole model a is then
    the slower device, but at an even split its 512 rows read at 1 ns like everything else, so
    even shares balance the reads: proportional ones would give a fewer rows than it reads as
    fast as b does."""
    spec = ModelSpec(
        model_type="llama",
        hidden_size=8,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=2,
        ffn_sizes={"ffn": 1024},
        vocab_size=1024,
        tie_word_embeddings=True,
    )
    ns = 1e-9

    def table(step: float) -> MatvecTable:
        along_n = [(8, n, 32 * n * ns) for n in range(1, 1025)]  # x (8) into n outputs
        along_k = [(k, 8, 32 * k * ns * (step if k > 512 else 1.0)) for k in range(1, 1025)]
        return MatvecTable.of(along_n + [p for p in along_k if p[0] != 8])

    devices = tuple(
        with_read_speed(
            spec,
            DeviceCost(name=name, seconds_per_byte=ns, prefill_flops=1e12, memory=GB).model_copy(
                update={"matvec": table(step)}
            ),
        )
        for name, step in (("a", 3.0), ("b", 1.0))
    )
    assert devices[0].speed < 0.75 * devices[1].speed  # slower over the whole model
    cluster = Cluster(devices=devices, default_link=THUNDERBOLT)
    choice = choose_plan(spec, cluster, context_tokens=64)
    tp = (
        next(c for c in (choice.best, *choice.alternatives) if c.kind == "tensor parallel")
        .plan.stages[0]
        .tp
    )
    assert tp.weights == pytest.approx((0.5, 0.5))
    assert [r.ffn["ffn"].size for r in tp.ranks] == [512, 512]


def test_a_model_batched_one_sequence_at_a_time_gains_nothing_under_load() -> None:
    """DeepSeek V4.1 runs a batch one sequence at a time (its caches cannot be batched): its
    loaded throughput is one stream's rate, where a batchable model's grows with the batch."""
    from arch_configs import tiny_config

    from exo_tp.plan import spec_from_config

    cluster = Cluster(devices=(device("a", 100, 64),), default_link=THUNDERBOLT)
    for arch, gains in (("deepseek_v41", False), ("deepseek_v32", True)):
        spec = spec_from_config(tiny_config(arch))
        alone = predict(single_stage(plan_tensor_parallel(spec, [1])), [0], cluster, 2048)
        loaded = alone.model_copy(update={"streams": 8})
        ratio = loaded.loaded_tokens_per_second / alone.tokens_per_second
        assert ratio > 2 if gains else ratio == pytest.approx(1), arch


# A 1B-class llama in 4-bit, as a draft model for SPEC (exo_tp.plan.draft).
DRAFT = SPEC.model_copy(
    update={"hidden_size": 2048, "num_layers": 16, "num_heads": 32, "ffn_sizes": {"ffn": 8192}}
)


def test_a_draft_model_sits_beside_the_conductor_in_memory() -> None:
    """The draft's weights and its KV cache for the context are counted on rank 0 (the
    conductor) of a one-stage plan, nowhere else; a TP plan that fits without it but not with
    it gives way to pipeline stages that fit with it on their conductor (the last stage's first
    rank), which holds fewer layers to make room."""
    from exo_tp.plan.draft import draft_cost

    draft = draft_cost(DRAFT, "draft")
    assert 0.5 * GB < draft.weights < 1.5 * GB and draft.kv_per_token > 0
    roomy = Cluster(devices=(device("a", 100, 64), device("b", 100, 64)), default_link=THUNDERBOLT)
    plain = choose_plan(SPEC, roomy, context_tokens=4096)
    drafting = choose_plan(SPEC, roomy, context_tokens=4096, draft=draft)
    assert drafting.best.kind == plain.best.kind == "tensor parallel"
    with_draft = {m.rank: m.total for m in drafting.best.prediction.memory}
    without = {m.rank: m.total for m in plain.best.prediction.memory}
    assert with_draft[0] - without[0] == draft.bytes_at(4096)
    assert with_draft[1] == without[1]
    # memory for the model split two ways and its KV cache, not for the draft beside it
    tight = Cluster(
        devices=(device("a", 100, 4.0), device("b", 100, 4.0)), default_link=THUNDERBOLT
    )
    alone = choose_plan(SPEC, tight, context_tokens=4096).best
    assert alone.kind == "tensor parallel"
    assert max(m.total for m in alone.prediction.memory) + draft.bytes_at(4096) > 4.0 * GB
    instead = choose_plan(SPEC, tight, context_tokens=4096, draft=draft).best
    assert len(instead.plan.stages) == 2, instead.kind
    conductor = instead.plan.stages[-1].ranks[0]
    drafts = {m.rank: m.draft for m in instead.prediction.memory}
    assert drafts == {r: draft.bytes_at(4096) if r == conductor else 0 for r in drafts}
    assert all(m.fits for m in instead.prediction.memory)
    first, last = instead.plan.stages
    assert last.layers.stop - last.layers.start < first.layers.stop - first.layers.start
