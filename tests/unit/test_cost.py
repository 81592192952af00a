"""The cost model on hand-computed cases (pure, no MLX): bytes, FLOPs, collectives, hops."""

from __future__ import annotations

import pytest

from exo_tp.plan import ModelSpec, Quantization, Span, plan_tensor_parallel
from exo_tp.plan.cluster import (
    Cluster,
    DeviceCost,
    Link,
    cluster_from_profiles,
    profile_read_speed,
)
from exo_tp.plan.cost import (
    FLOAT_BYTES,
    HOP_OVERHEAD,
    LinkCost,
    all_gather_seconds,
    all_sum_seconds,
    bytes_per_weight,
    collective_seconds,
    rank_load,
    weight_format,
)
from exo_tp.plan.devices import DeviceProfile, MatmulScore
from exo_tp.plan.matvec import MatvecTable
from exo_tp.plan.pipeline import plan_pipeline, single_stage
from exo_tp.plan.predict import predict
from exo_tp.profile.shapes import model_shapes
from exo_tp.wire.profiles import LinkProfile

LINK = LinkCost(latency=1e-4, bandwidth=1e9, measured=True)
EVERY = Span(start=0, stop=2)


def tiny(**changes: object) -> ModelSpec:
    # 2 layers, hidden 8, 4 heads / 2 KV heads of width 2, FFN 64, vocab 128, tied.
    fields = dict(
        model_type="llama",
        hidden_size=8,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=2,
        ffn_sizes={"ffn": 64},
        vocab_size=128,
        tie_word_embeddings=True,
    )
    return ModelSpec(**{**fields, **changes})


def test_rank_bytes_by_hand() -> None:
    spec = tiny()
    shard = plan_tensor_parallel(spec, [1, 1]).ranks[0]
    # 2 q heads (width 4), 1 KV head (width 2), 32 FFN rows, 64 vocab rows.
    # layer = 8*(2*4 + 2*2) attention + 3*8*32 FFN = 96 + 768 = 864 weights
    # 2 layers * 864 * 4 B = 6912; head 64*8*4 = 2048; norms (2*2+1)*8*4 = 160
    load = rank_load(spec, shard, EVERY, True, True)
    assert (load.held_bytes, load.read_bytes) == (9120, 9120)
    assert load.kv_bytes_per_token == 2 * (2 * 1 * 2 * 4)  # 2 layers of K and V, 1 head of 2
    untied = tiny(tie_word_embeddings=False)
    load = rank_load(untied, plan_tensor_parallel(untied, [1, 1]).ranks[0], EVERY, True, True)
    assert (load.held_bytes, load.read_bytes) == (11168, 9120)  # embedding held, barely read
    # Pipeline ends: the first stage holds the embedding, the last the head and final norm.
    first = rank_load(spec, shard, Span(start=0, stop=1), True, False)
    last = rank_load(spec, shard, Span(start=1, stop=2), False, True)
    assert (first.held_bytes, first.read_bytes) == (3456 + 2048 + 64, 3456 + 64)
    assert (last.held_bytes, last.read_bytes) == (3456 + 2048 + 96,) * 2


def test_quantized_bytes_by_hand() -> None:
    spec = tiny(quantization=Quantization(group_size=32, bits=4))
    assert bytes_per_weight(spec) == 0.5 + 2 * 4 / 32
    assert weight_format(spec) == "q4g32" and weight_format(tiny()) == "float32"
    plan = plan_tensor_parallel(spec, [1, 1])
    # o_proj's column cut must land on a group of 32 columns = 16 heads: rank 0 holds all 4
    # heads (layer: 8*(2*8 + 2*4) + 768 = 960 weights), rank 1 none (768); both 32 FFN rows.
    # 2 layers * weights * 0.75 B + 64*8 head weights * 0.75 B + 160 norm bytes
    reads = [rank_load(spec, r, EVERY, True, True).read_bytes for r in plan.ranks]
    assert reads == [1440 + 384 + 160, 1152 + 384 + 160]


def test_moe_holds_every_expert_and_reads_the_active_ones() -> None:
    # Layer 0 dense (FFN 64), layer 1 MoE: 4 experts of 32 rows, 2 per token, router 8x4.
    spec = tiny(
        ffn_sizes={"ffn": 64, "expert_ffn": 32}, num_experts=4, experts_per_token=2, dense_layers=1
    )
    shard = plan_tensor_parallel(spec, [1]).ranks[0]
    attention = 8 * (2 * 8 + 2 * 4)
    dense = attention + 3 * 8 * 64
    moe_held, moe_read = attention + 4 * 768 + 32, attention + 2 * 768 + 32
    load = rank_load(spec, shard, EVERY, True, True)
    assert load.held_bytes == (dense + moe_held) * 4 + 128 * 8 * 4 + 160
    assert load.read_bytes == (dense + moe_read) * 4 + 128 * 8 * 4 + 160
    assert load.flops_per_token == 2 * (dense + moe_read + 128 * 8)


def test_ring_collective_model_by_hand() -> None:
    assert all_sum_seconds(2, 4096, LINK) == pytest.approx(1e-4 + 4096 / 1e9)
    assert all_sum_seconds(3, 3000, LINK) == pytest.approx(2e-4 + 4 / 3 * 3000 / 1e9)
    assert all_gather_seconds(3, 1000, LINK) == pytest.approx(2 * (5e-5 + 1000 / 1e9))
    assert all_sum_seconds(1, 4096, LINK) == all_gather_seconds(1, 4096, LINK) == 0


def test_collectives_by_stage_position() -> None:
    plan = plan_tensor_parallel(tiny(), [1, 1])
    one_sum = 1e-4 + 32 / 1e9  # 8 floats over 2 ranks
    gather = 5e-5 + 256 / 1e9  # 64 padded floats per rank
    # Whole model: 2 per layer + embedding all_sum, and the logits gather.
    assert collective_seconds(plan, 2, True, True, LINK) == pytest.approx(5 * one_sum + gather)
    # A middle stage of one layer: its two all_sums only.
    assert collective_seconds(plan, 1, False, False, LINK) == pytest.approx(2 * one_sum)
    # A 10-token prompt: all_sums carry 10 rows; logits only for the last position.
    assert collective_seconds(plan, 2, True, True, LINK, tokens=10) == pytest.approx(
        5 * (1e-4 + 320 / 1e9) + gather
    )


def _device(name: str, seconds_per_byte: float, memory: int = 10**9) -> DeviceCost:
    return DeviceCost(
        name=name, seconds_per_byte=seconds_per_byte, prefill_flops=1e9, memory=memory
    )


def test_tensor_parallel_prediction_by_hand() -> None:
    plan = single_stage(plan_tensor_parallel(tiny(), [1, 1]))
    cluster = Cluster(devices=(_device("a", 1e-9), _device("b", 2e-9)), default_link=LINK)
    p = predict(plan, [0, 1], cluster, context_tokens=10, prompt_tokens=4)
    comm = 5 * (1e-4 + 32 / 1e9) + (5e-5 + 256 / 1e9)
    assert p.stages[0].compute_seconds == pytest.approx(9120 * 2e-9)  # the slower rank
    assert p.decode_seconds == pytest.approx(9120 * 2e-9 + comm)
    assert p.hop_seconds == 0
    assert [(m.weights, m.kv_cache) for m in p.memory] == [(9120, 320), (9120, 320)]
    # Prefill of 4 tokens: 2 * 4 * read weights (2 layers * 864 + 64*8 head) + attention
    # 2 * (2 layers * 2 heads * 2 wide) * 4^2, on the rank at 1 GFLOP/s; all_sums carry 4 rows.
    flops = 2 * 4 * (2 * 864 + 512) + 2 * 8 * 16
    comm4 = 5 * (1e-4 + 128 / 1e9) + (5e-5 + 256 / 1e9)
    assert p.prefill_seconds == pytest.approx(flops / 1e9 + comm4)


@pytest.mark.parametrize(("bits", "per_token"), [(None, 1024), (8, 288), (4, 160)])
def test_kv_bytes_at_the_quantized_width_and_the_context_each_plan_fits(
    bits: int | None, per_token: int
) -> None:
    """2 KV heads of width 64 over 2 even ranks, float32: each rank adds 2 layers x keys and
    values x 64 x 4 bytes = 1024 bytes per token; quantized, each element takes bits / 8 bytes
    plus a float32 scale and bias per group of 64 (8 bits: 1.125 bytes, 4 bits: 0.625). 3
    streams each with the planned context share what memory leaves beside the weights."""
    from exo_tp.plan.kv_width import KvShape

    spec = tiny(head_dim=64)
    plan = single_stage(plan_tensor_parallel(spec, [1, 1]))
    memory = 2 * 10**6
    cluster = Cluster(
        devices=(_device("a", 1e-9, memory), _device("b", 1e-9, memory)), default_link=LINK
    )
    kv = KvShape(bits=bits, group_size=64, streams=3)
    p = predict(plan, [0, 1], cluster, context_tokens=100, prompt_tokens=4, kv=kv)
    weights = p.memory[0].weights
    assert [m.kv_per_token for m in p.memory] == [per_token, per_token]
    assert p.memory[0].kv_cache == 3 * 100 * per_token
    assert p.context_fits == (memory - weights) // (3 * per_token)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5", "nemotron_h", "lfm2"])
def test_the_leaders_kv_admission_counts_each_streams_recurrent_state_as_the_planner_does(
    arch: str,
) -> None:
    """A hybrid family keeps recurrent state per stream beside its KV. Memory for exactly the
    weights, 4 streams' state and 100 tokens of KV on the fuller rank: the leader's admission
    (kv_token_capacity, all streams) admits those 100 tokens, no more (leaving the state out
    it would admit 4 streams' state worth of extra tokens), and equals the planner's context
    per stream (RankMemory.context_fits) times the streams."""
    from arch_configs import tiny_config

    from exo_tp.plan import spec_from_config
    from exo_tp.plan.cost import stage_state_bytes
    from exo_tp.plan.kv_width import KvShape, kv_token_capacity, rank_kv_bytes_per_token

    spec = spec_from_config(tiny_config(arch))
    plan = single_stage(plan_tensor_parallel(spec, [0.6, 0.4]))
    stage, streams = plan.stages[0], 4
    loads = [rank_load(spec, shard, stage.layers, True, True) for shard in stage.tp.ranks]
    states = [stage_state_bytes(spec, shard, stage.layers) for shard in stage.tp.ranks]
    per_token = [rank_kv_bytes_per_token(plan, r, FLOAT_BYTES, None) for r in stage.ranks]
    assert min(states) > 0 and min(per_token) > 0, (states, per_token)
    free = [
        x.held_bytes + streams * s + 100 * t
        for x, s, t in zip(loads, states, per_token, strict=True)
    ]
    capacity = kv_token_capacity(plan, free, FLOAT_BYTES, None, streams=streams)
    assert capacity == 100
    # the recurrent state is no rounding error: without it the same memory holds more tokens
    assert kv_token_capacity(plan, free, FLOAT_BYTES, None, streams=1) > capacity
    cluster = Cluster(
        devices=tuple(_device(n, 1e-9, m) for n, m in zip("ab", free, strict=True)),
        default_link=LINK,
    )
    p = predict(plan, [0, 1], cluster, context_tokens=10, kv=KvShape(streams=streams))
    assert p.context_fits == capacity // streams


@pytest.mark.parametrize("overhead", [1e-5, 1e-3])
def test_segments_wait_for_their_slowest_rank_and_overheads_are_not_divided(
    overhead: float,
) -> None:
    """3 KV heads over 2 even ranks: rank 0 takes 2 heads, rank 1 one, each 64 FFN rows and 64
    vocab rows. On devices of 1 and 1.5 ns per byte the attention segment waits for rank 0 and
    the FFN and head for rank 1: a token costs more than the slowest rank's whole reads. A
    collective costs its link (100 us latency), or half a layer's overhead if that is more."""
    spec = tiny(num_heads=3, num_kv_heads=3, ffn_sizes={"ffn": 128})
    plan = single_stage(plan_tensor_parallel(spec, [1, 1]))
    ranks = plan.stages[0].tp.ranks
    assert [(r.heads.q_heads.size, r.ffn["ffn"].size, r.vocab.size) for r in ranks] == [
        (2, 64, 64),
        (1, 64, 64),
    ]
    devices = tuple(
        DeviceCost(
            name=name,
            seconds_per_byte=spb,
            prefill_flops=1e9,
            memory=10**9,
            layer_overhead=overhead,
        )
        for name, spb in (("a", 1e-9), ("b", 1.5e-9))
    )
    p = predict(plan, [0, 1], Cluster(devices=devices, default_link=LINK), 10, 4)
    # bytes: attention 2 layers * 8 * (2 q + 2 kv width) * 4; FFN 2 * 3 * 8 * 64 * 4 plus the
    # norms (2 * 2 + 1) * 8 * 4; head 64 * 8 * 4
    attention, ffn, head = (1024, 512), 12288 + 160, 2048
    reads = max(attention[0] * 1e-9, attention[1] * 1.5e-9) + ffn * 1.5e-9 + head * 1.5e-9
    slowest_whole = (attention[1] + ffn + head) * 1.5e-9
    assert reads == pytest.approx(slowest_whole + 256e-9)  # the attention imbalance is paid
    # each rank runs both layers, and the last stage 8 layers' worth for its step loop
    assert p.stages[0].compute_seconds == pytest.approx(reads + (2 + 8) * overhead)
    # 6 collectives (2 per layer, embedding, logits): 5 all_sums and the logits' all_gather
    comm = 5 * (1e-4 + 32 / 1e9) + (5e-5 + 256 / 1e9)
    floor = {1e-5: 0.0, 1e-3: 0.5e-3 - 1e-4}[overhead]  # under the link's latency: nothing
    assert p.stages[0].collective_seconds == pytest.approx(comm + 6 * floor)


def test_pipeline_prediction_by_hand() -> None:
    plan = plan_pipeline(tiny(), [[1], [1]], [1, 1])
    cluster = Cluster(
        devices=(_device("a", 1e-9), _device("b", 2e-9)),
        links=(Link(a=0, b=1, cost=LINK),),
        default_link=LinkCost(latency=1, bandwidth=1, measured=False),
    )
    p = predict(plan, [0, 1], cluster, context_tokens=10, prompt_tokens=4)
    layer = 8 * (2 * 8 + 2 * 4) + 3 * 8 * 64  # one rank: all heads, all FFN rows
    stage0 = (layer * 4 + 2 * 8 * 4) * 1e-9  # its layer and 2 norms (embedding lookup free)
    stage1 = (layer * 4 + 128 * 8 * 4 + 3 * 8 * 4) * 2e-9  # + the head and final norm
    # token to stage 0, hidden to stage 1; each also wakes a rank blocked on its socket
    hops = 2 * HOP_OVERHEAD + (1e-4 + 4 / 1e9) + (1e-4 + 8 * 4 / 1e9)
    assert [s.compute_seconds for s in p.stages] == pytest.approx([stage0, stage1])
    assert p.hop_seconds == pytest.approx(hops)
    assert p.decode_seconds == pytest.approx(stage0 + stage1 + hops)
    assert [m.kv_cache for m in p.memory] == [320, 320]  # 1 layer x 10 tokens x K,V x 2 x 2
    assert p.prefill_hop_seconds == pytest.approx(
        2 * HOP_OVERHEAD + (1e-4 + 16 / 1e9) + (1e-4 + 128 / 1e9)
    )
    tight = cluster.model_copy(
        update={"devices": (_device("a", 1e-9, memory=5000), _device("b", 2e-9))}
    )
    over = predict(plan, [0, 1], tight, context_tokens=10).overflow()
    assert over is not None and over.device == 0 and over.total == layer * 4 + 4096 + 64 + 320


def _kernel(kind: str, dtype: str, rate: float) -> MatmulScore:
    return MatmulScore(
        kind=kind, dtype=dtype, m=1, k=8, n=8, seconds=0.01, flops=1e9, weight_bytes_per_second=rate
    )


def _profile(node_id: str, links: tuple[LinkProfile, ...] = ()) -> DeviceProfile:
    return DeviceProfile(
        node_id=node_id,
        chip="x",
        cores=1,
        mlx_version="0",
        mlx_device="cpu",
        memory_total=2000,
        memory_available=1000,
        backends=(),
        memory_bandwidth=1.0,
        decode_seconds_per_byte=5e-10,
        prefill_flops=3.0,
        links=links,
        kernels=(
            _kernel("matvec", "q4g32", 1e9),
            _kernel("matvec", "q4g32", 4e9),
            _kernel("matmul", "q4g32", 1.0),
        ),
    )


def test_scores_per_weight_format() -> None:
    profile = _profile("0@x")
    q4 = profile.decode_score("q4g32")
    assert q4.seconds_per_byte == pytest.approx((1e-9 + 0.25e-9) / 2) and q4.measured
    bf16 = profile.decode_score("bfloat16")  # not measured: the headline score, and it says so
    assert bf16.seconds_per_byte == 5e-10 and not bf16.measured
    assert profile.decode_score("float32").measured  # the headline's own format
    assert profile.decode_speed == pytest.approx(2e9)


def test_cluster_from_profiles_uses_measured_links_and_headroom() -> None:
    links = (
        LinkProfile(a="0@x", b="1@y", up=True, all_sum_latency=3e-4, all_sum_bandwidth=2e9),
        LinkProfile(a="1@y", b="2@z", up=False, error="unreachable"),
        LinkProfile(a="0@x", b="9@gone", up=True, all_sum_latency=1, all_sum_bandwidth=1),
    )
    cluster = cluster_from_profiles(
        tiny(quantization=Quantization(group_size=32, bits=4)),
        [_profile("0@x", links), _profile("1@y"), _profile("2@z")],
    )
    assert cluster.devices[0].seconds_per_byte == pytest.approx(0.625e-9)  # q4g32 score
    assert cluster.devices[0].memory == 900  # 90% of what is available
    assert cluster.link(1, 0) == LinkCost(latency=3e-4, bandwidth=2e9, measured=True)
    assert cluster.link(1, 2).latency >= 3600  # down: priced out
    assert cluster.link(0, 2) == cluster.default_link


def test_matvec_table_interpolates_along_the_dimension_that_differs() -> None:
    table = MatvecTable.of([(8, 16, 1e-6), (8, 32, 4e-6), (16, 8, 2e-6), (48, 8, 4e-6)])
    assert table.seconds(8, 16) == 1e-6  # measured
    assert table.seconds(8, 24) == pytest.approx(2.5e-6)  # halfway along n
    assert table.seconds(32, 8) == pytest.approx(3e-6)  # halfway along k
    assert table.seconds(8, 64) == pytest.approx(8e-6)  # past the end: its seconds per byte
    assert table.seconds(8, 8) == pytest.approx(0.5e-6)  # nearer the n = 16 end than k = 16's
    assert table.seconds(12, 8) == pytest.approx(1.5e-6)  # below k = 16: per byte from there
    assert table.seconds(4, 8) is None  # 4x below any measured k: too far to tell
    assert table.seconds(3, 5) is None  # no measured shape shares k or n
    assert table.seconds(0, 8) == 0.0


def test_each_matrix_of_a_split_is_priced_by_its_measured_shape() -> None:
    """Even halves of the tiny model (q 8 -> 4, k/v 8 -> 2, o 4 -> 8, gate/up 8 -> 32, down
    32 -> 8, head 8 -> 64) on a device that measured some of those shapes: each matrix costs
    its shape's seconds, interpolated or scaled per byte; the norms' bytes cost the score."""
    spec = tiny()
    plan = single_stage(plan_tensor_parallel(spec, [1, 1]))
    table = MatvecTable.of(
        [(8, 2, 1e-6), (8, 16, 2e-6), (8, 64, 6e-6), (4, 8, 3e-6), (64, 8, 10e-6)]
    )
    device = DeviceCost(name="a", seconds_per_byte=1e-9, prefill_flops=1e9, memory=10**9)
    shaped = device.model_copy(update={"matvec": table})
    q, kv, o = 1e-6 + 1e-6 * 2 / 14, 1e-6, 3e-6
    gate_up, down, head = 2e-6 + 4e-6 * 16 / 48, 3e-6 + 7e-6 * 28 / 60, 6e-6
    # down (32 -> 8) lies on the k curve between k = 4 and k = 64 (n = 8)
    per_layer = q + 2 * kv + o + 2 * gate_up + down
    norms = (2 * 2 + 1) * 8 * 4 * 1e-9
    for seconds_per_byte_only, expected in (
        (False, 2 * per_layer + head + norms),
        (True, 9120 * 1e-9),  # every byte at the score, as without the table
    ):
        cluster = Cluster(devices=(device if seconds_per_byte_only else shaped,) * 2)
        p = predict(plan, [0, 1], cluster, 10, 4)
        assert p.stages[0].compute_seconds == pytest.approx(expected)


def test_the_bench_times_each_matrix_at_eighths_of_its_split_dimension() -> None:
    # q 8 wide (an eighth rounds up to 8), k/v 4 (never past the width), FFN 64 in eighths,
    # vocab 128 in eighths; o_proj and down read those slices into the hidden size.
    outputs = {8, 4} | set(range(8, 65, 8)) | set(range(16, 129, 16))
    inputs = {8} | set(range(8, 65, 8))
    assert model_shapes(tiny()) == (
        "float32",
        tuple(sorted({(8, n) for n in outputs} | {(k, 8) for k in inputs})),
    )
    # Quantized: every slice a multiple of the group; the router (8 experts) is never split.
    spec = tiny(
        hidden_size=64,
        head_dim=16,
        ffn_sizes={"ffn": 256},
        quantization=Quantization(group_size=32, bits=4),
        num_experts=8,
        experts_per_token=2,
    )
    fmt, shapes = model_shapes(spec)
    assert fmt == "q4g32" and (64, 8) in shapes
    assert {k for k, n in shapes if n == 64} == set(range(32, 257, 32))
    assert all(k % 32 == 0 for k, _ in shapes)


def shape(dtype: str, k: int, n: int, seconds: float) -> MatmulScore:
    """A measured matvec of one of a model's shapes, as `exo-tp bench --model` stores it."""
    return MatmulScore(
        kind="matvec",
        dtype=dtype,
        m=1,
        k=k,
        n=n,
        seconds=seconds,
        flops=2 * k * n / seconds,
        weight_bytes_per_second=1.0,
    )


def test_cluster_prices_the_model_by_the_shapes_of_its_weight_format() -> None:
    profile = _profile("0@x").model_copy(
        update={"shapes": (shape("float32", 8, 64, 1e-6), shape("q4g32", 8, 64, 2e-6))}
    )
    float_device = cluster_from_profiles(tiny(), [profile]).devices[0]
    assert float_device.matvec == MatvecTable.of([(8, 64, 1e-6)])
    q4 = tiny(quantization=Quantization(group_size=32, bits=4))
    assert cluster_from_profiles(q4, [profile]).devices[0].matvec.seconds(8, 64) == 2e-6


def test_a_device_with_shapes_shares_at_the_speed_they_price_the_whole_model() -> None:
    """The tiny model on one rank reads q 8 -> 8, k/v 8 -> 4 (twice), o 8 -> 8, gate/up
    8 -> 64 (twice) and down 64 -> 8 per layer, the head 8 -> 128 once, and 160 bytes of norms
    at the score: its share speed is those bytes over those seconds, from the profile the
    bench wrote and from the summary a node sends its leader alike."""

    f32 = "float32"
    measured = (
        shape(f32, 8, 8, 1e-6),
        shape(f32, 8, 4, 0.5e-6),
        shape(f32, 8, 64, 4e-6),
        shape(f32, 64, 8, 6e-6),
    )
    profile = _profile("0@x").model_copy(update={"shapes": (*measured, shape(f32, 8, 128, 10e-6))})
    per_layer = 1e-6 + 2 * 0.5e-6 + 1e-6 + 2 * 4e-6 + 6e-6
    seconds = 2 * per_layer + 10e-6 + 160 * 5e-10
    whole = 2 * 4 * (8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 64) + 4 * 8 * 128 + 160
    assert whole == 18080
    device = cluster_from_profiles(tiny(), [profile]).devices[0]
    assert device.speed == pytest.approx(whole / seconds)
    assert profile_read_speed(tiny(), profile.summary()) == pytest.approx(whole / seconds)
    # The head unmeasured: 8 -> 128 is twice 8 -> 64, so it reads as 8 -> 64 does per byte
    partial = profile.model_copy(update={"shapes": measured})
    assert profile_read_speed(tiny(), partial) == pytest.approx(
        whole / (2 * per_layer + 2 * 4e-6 + 160 * 5e-10)
    )
    # No shapes of the model's format: the decode score
    q4 = tiny(quantization=Quantization(group_size=32, bits=4), hidden_size=64, head_dim=16)
    assert profile_read_speed(q4, profile) == pytest.approx(profile.decode_score("q4g32").speed)


def test_a_vision_tower_is_counted_on_the_first_stages_first_rank() -> None:
    """Its bytes beside that rank's shard (and nowhere else), its time per image at that
    device's prefill speed: every weight once per patch (exo_tp.plan.vision)."""
    spec = tiny(vision_bytes=4000, vision_patches=256)
    plan = plan_pipeline(spec, [[1], [1]], [1, 1])
    cluster = Cluster(
        devices=(_device("a", 1e-9), _device("b", 2e-9)),
        links=(Link(a=0, b=1, cost=LINK),),
        default_link=LinkCost(latency=1, bandwidth=1, measured=False),
    )
    p = predict(plan, [1, 0], cluster, context_tokens=10, prompt_tokens=4)
    text = predict(plan_pipeline(tiny(), [[1], [1]], [1, 1]), [1, 0], cluster, 10, 4)
    assert [m.tower for m in p.memory] == [4000, 0]
    assert [m.total - t.total for m, t in zip(p.memory, text.memory, strict=True)] == [4000, 0]
    assert p.tower_seconds == pytest.approx(2 * 4000 / spec.dtype_bytes * 256 / 1e9)
    assert text.tower_seconds == 0
