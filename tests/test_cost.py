"""The decode-time prediction on hand-computed numbers (pure, no MLX)."""

from __future__ import annotations

import pytest

from exo_tp.plan import ModelSpec, Quantization, plan_tensor_parallel
from exo_tp.plan.cost import (
    LinkCost,
    all_gather_seconds,
    all_sum_seconds,
    bytes_per_weight,
    collective_seconds,
    predict_decode,
    shard_bytes,
    weight_format,
    worst_link,
)
from exo_tp.plan.devices import DeviceProfile, LinkProfile, MatmulScore

LINK = LinkCost(latency=1e-4, bandwidth=1e9, measured=True)


def tiny(**changes: object) -> ModelSpec:
    # 2 layers, hidden 8, 4 heads / 2 KV heads of width 2, FFN 64, vocab 128, tied.
    fields = dict(model_type="llama", hidden_size=8, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=2, ffn_sizes={"ffn": 64}, vocab_size=128, tie_word_embeddings=True)
    return ModelSpec(**{**fields, **changes})


def test_shard_bytes_by_hand() -> None:
    plan = plan_tensor_parallel(tiny(), [1, 1])
    # Each rank: 2 q heads (width 4), 1 KV head (width 2), 32 FFN rows, 64 vocab rows.
    # layer = 8*(2*4 + 2*2) attention + 3*8*32 FFN = 96 + 768 = 864 weights
    # 2 layers * 864 * 4 B = 6912; head 64*8*4 = 2048; norms (2*2+1)*8*4 = 160
    assert [(b.memory, b.decode) for b in shard_bytes(plan)] == [(9120, 9120), (9120, 9120)]
    untied = plan_tensor_parallel(tiny(tie_word_embeddings=False), [1, 1])
    assert [(b.memory, b.decode) for b in shard_bytes(untied)] == [(11168, 9120)] * 2


def test_quantized_bytes_by_hand() -> None:
    spec = tiny(quantization=Quantization(group_size=32, bits=4))
    assert bytes_per_weight(spec) == 0.5 + 2 * 4 / 32
    assert weight_format(spec) == "q4g32" and weight_format(tiny()) == "float32"
    plan = plan_tensor_parallel(spec, [1, 1])
    # o_proj's column cut must land on a group of 32 columns = 16 heads: rank 0 holds all 4
    # heads (layer: 8*(2*8 + 2*4) + 768 = 960 weights), rank 1 none (768); both 32 FFN rows.
    # 2 layers * weights * 0.75 B + 64*8 head weights * 0.75 B + 160 norm bytes
    assert [b.decode for b in shard_bytes(plan)] == [1440 + 384 + 160, 1152 + 384 + 160]


def test_ring_collective_model_by_hand() -> None:
    assert all_sum_seconds(2, 4096, LINK) == pytest.approx(1e-4 + 4096 / 1e9)
    assert all_sum_seconds(3, 3000, LINK) == pytest.approx(2e-4 + 4 / 3 * 3000 / 1e9)
    assert all_gather_seconds(3, 1000, LINK) == pytest.approx(2 * (5e-5 + 1000 / 1e9))
    assert all_sum_seconds(1, 4096, LINK) == all_gather_seconds(1, 4096, LINK) == 0


def test_prediction_by_hand() -> None:
    plan = plan_tensor_parallel(tiny(), [1, 1])
    # 5 all_sums (2 per layer + embedding) of 8 floats, 1 all_gather of 64 floats per rank
    comm = 5 * (1e-4 + 32 / 1e9) + (5e-5 + 256 / 1e9)
    assert collective_seconds(plan, LINK) == pytest.approx(comm)
    prediction = predict_decode(plan, [1e-9, 2e-9], LINK)
    assert [r.compute_seconds for r in prediction.ranks] == pytest.approx([9.12e-6, 18.24e-6])
    assert prediction.seconds == pytest.approx(18.24e-6 + comm)
    assert prediction.slowest_rank == 1
    single = predict_decode(plan_tensor_parallel(tiny(), [1]), [1e-9], LINK)
    assert single.collective_seconds == 0
    assert single.seconds == pytest.approx((2 * 8 * (2 * 8 + 2 * 4 + 3 * 64) * 4 + 128 * 8 * 4
                                            + 160) * 1e-9)


def test_worst_link_ignores_down_links() -> None:
    links = [
        LinkProfile(a="0@x", b="1@y", up=True, all_sum_latency=1e-4, all_sum_bandwidth=2e9),
        LinkProfile(a="0@x", b="2@z", up=True, all_sum_latency=3e-4, all_sum_bandwidth=5e9),
        LinkProfile(a="1@y", b="2@z", up=False, error="unreachable"),
    ]
    assert worst_link(links) == LinkCost(latency=3e-4, bandwidth=2e9, measured=True)
    assert worst_link(links[2:]) is None


def _kernel(kind: str, dtype: str, rate: float, seconds: float = 0.01,
            flops: float = 1e9) -> MatmulScore:
    return MatmulScore(kind=kind, dtype=dtype, m=1, k=8, n=8, seconds=seconds, flops=flops,
                       weight_bytes_per_second=rate)


def test_scores_per_weight_format() -> None:
    profile = DeviceProfile(
        chip="x", cores=1, mlx_version="0", mlx_device="cpu", memory_total=1,
        memory_available=1, backends=(), memory_bandwidth=1.0, decode_seconds_per_byte=5e-10,
        prefill_flops=1.0,
        kernels=(_kernel("matvec", "q4g32", 1e9), _kernel("matvec", "q4g32", 4e9),
                 _kernel("matmul", "q4g32", 1.0)),
    )
    assert profile.seconds_per_byte("q4g32") == pytest.approx((1e-9 + 0.25e-9) / 2)
    assert profile.seconds_per_byte("bfloat16") == 5e-10  # not measured: the headline score
    assert profile.decode_speed == pytest.approx(2e9)
