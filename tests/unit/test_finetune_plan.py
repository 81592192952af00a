"""The pure pieces of `exo-tp finetune`: row cuts, micro-batch shares, the cost model; and the
padded dim-0 all-gather on real ring ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from ring_harness import run_on_ranks

from exo_tp.errors import ExoTpError
from exo_tp.finetune.cost import (
    Device,
    Workload,
    base_bytes,
    estimate_replicas,
    estimate_sharded,
)
from exo_tp.plan.cost import LinkCost
from exo_tp.plan.finetune import batch_rows, plan_finetune, split_rows
from exo_tp.plan.spec import ModelSpec

weights = st.lists(st.floats(min_value=0.05, max_value=10), min_size=1, max_size=8)


@given(
    rows=st.integers(min_value=0, max_value=5000), w=weights, granule=st.sampled_from([1, 8, 32])
)
def test_row_split_covers_every_row_once_in_proportion(
    rows: int, w: list[float], granule: int
) -> None:
    split = split_rows(rows, w, granule)
    assert split.spans[0].start == 0 and split.spans[-1].stop == rows
    assert all(a.stop == b.start for a, b in zip(split.spans, split.spans[1:], strict=False))
    total = sum(w)
    for span, weight in zip(split.spans, w, strict=True):
        # within one granule of the share, plus a last granule that stops short
        assert abs(span.size - rows * weight / total) <= 2 * granule
        assert span.start % granule == 0 or span.start == rows
    assert split.padded == max(split.sizes)
    assert all(split.padded - s == p for s, p in zip(split.sizes, split.padding, strict=True))


def test_row_split_by_hand() -> None:
    assert split_rows(10, [0.7, 0.3]).sizes == (7, 3)
    assert split_rows(1536, [5, 3, 2]).sizes == (768, 461, 307)
    assert split_rows(100, [1, 1], granule=32).sizes == (64, 36)  # 4 granules, last short
    assert split_rows(5, [1, 1, 1, 1, 1, 1, 1]).sizes == (1, 1, 1, 1, 1, 0, 0)


@given(batch=st.integers(min_value=1, max_value=256), w=weights)
def test_batch_rows_follow_speed_with_one_row_each(batch: int, w: list[float]) -> None:
    if batch < len(w):
        with pytest.raises(ExoTpError, match="smaller than"):
            batch_rows(batch, w)
        return
    spans = batch_rows(batch, w)
    assert spans[0].start == 0 and spans[-1].stop == batch
    assert all(s.size >= 1 for s in spans)
    total = sum(w)
    for span, weight in zip(spans, w, strict=True):
        # at least one row, otherwise within one row of the proportional share
        assert span.size <= max(1.0, batch * weight / total) + 1


def test_batch_rows_by_hand() -> None:
    assert [s.size for s in batch_rows(4, [3, 1])] == [3, 1]
    assert [s.size for s in batch_rows(10, [5, 3, 2])] == [5, 3, 2]
    assert [s.size for s in batch_rows(3, [100, 1, 1])] == [1, 1, 1]
    assert [s.size for s in batch_rows(8, [100, 1, 1])] == [6, 1, 1]


def test_plan_refuses_bad_weights() -> None:
    with pytest.raises(ExoTpError, match="memory weights"):
        plan_finetune([1, 1], [1], 4)
    with pytest.raises(ExoTpError):
        plan_finetune([1, -1], [1, 1], 4)
    plan = plan_finetune([3, 1], [1, 1], 4)
    assert plan.rows(8).sizes == (6, 2) and [s.size for s in plan.batch] == [2, 2]


GATHER_ROWS = """
import json
from exo_tp.shard.collectives import CollectiveShapeError, gather_rows_padded
sizes = {sizes}
r = group.rank()
rows = sum(sizes)
# Whole tensors every rank can build: a packed 4-bit weight (uint32), float scales, a bias.
mx.random.seed(0)
w = mx.random.randint(0, 2**31, (rows, 6)).astype(mx.uint32)
scales = mx.random.normal((rows, 3))
bias = mx.random.normal((rows,)).astype(mx.bfloat16)
start = sum(sizes[:r])
mine = [t[start:start + sizes[r]] for t in (w, scales, bias)]
shapes = [t.shape for t in (w, scales, bias)]
comm = mx.new_stream(mx.cpu)
full = gather_rows_padded(mine, sizes, group, shapes, stream=comm)
# one tensor alone, and a second collective right after (a corrupted stream would show); on
# the same stream: collectives on two streams at once would interleave on the ring
(alone,) = gather_rows_padded([mine[1]], sizes, group, [scales.shape], stream=comm)
mx.eval(full, alone)
exact = all(mx.array_equal(a, b).item() for a, b in zip(full, (w, scales, bias)))
try:
    gather_rows_padded([mine[1][:, :2]], sizes, group, [scales.shape])
    caught = False
except CollectiveShapeError:
    caught = True
if r == 0:
    json.dump({{"exact": exact, "alone": mx.array_equal(alone, scales).item(),
               "caught": caught}}, open(OUT, "w"))
"""


@pytest.mark.parametrize("sizes", [[5, 0, 3], [7, 3], [2, 2]])
def test_gather_rows_padded_is_bit_exact_for_mixed_parts(tmp_path: Path, sizes: list[int]) -> None:
    out = run_on_ranks(len(sizes), GATHER_ROWS.format(sizes=sizes), tmp_path)
    assert out == {"exact": True, "alone": True, "caught": True}


def _tiny_spec(layers: int = 1) -> ModelSpec:
    return ModelSpec(
        model_type="llama",
        hidden_size=4,
        num_layers=layers,
        num_heads=2,
        num_kv_heads=1,
        head_dim=2,
        ffn_sizes={"ffn": 8},
        vocab_size=10,
        tie_word_embeddings=True,
    )


def test_cost_model_by_hand() -> None:
    """One layer (hidden 4, q 4, kv 2, ffn 8, vocab 10), bf16 weights (8 bytes per row of 4),
    two ranks of 1000 FLOP/s, one token each, a link of 2 ms and 1000 B/s."""
    spec, link = _tiny_spec(), LinkCost(latency=0.002, bandwidth=1000, measured=False)
    devices = [
        Device(name="a", memory=10**6, flops=1000),
        Device(name="b", memory=10**6, flops=1000),
    ]
    work = Workload(tokens=2, lora_params=0)
    # forward compute 2*rows*in/1000 per step: embedding lookup 0, q .032, k .016, v .016,
    # o .032, gate/up/down .064 each, head .08 (sum .368); gathers (L/2 + padded rows*bytes/B):
    # .041 .017 .009 .009 .017 .033 .033 .033 .041 (sum .233); the backward skips the lookup.
    serial = estimate_sharded(spec, devices, [1, 1], [1, 1], work, link, prefetch=False)
    assert serial.step_seconds == pytest.approx(0.368 + 0.233 + (0.368 + 0.192) + 0.002)
    assert serial.gather_seconds == pytest.approx(0.233 + 0.192)
    overlapped = estimate_sharded(spec, devices, [1, 1], [1, 1], work, link, prefetch=True)
    # forward: first gather, then max(step k, gather k+1): .041+.017+.032+.016+.017+.033+
    # .064*3+.08 = .428; backward from the head down to q: .041 (head's gather) + .08 (head)
    # + .064*3 (down, up, gate) + .032 (o) + .016 (v) + max(k .016, q's gather .017) + .032
    assert overlapped.step_seconds == pytest.approx(
        0.428 + (0.041 + 0.08 + 0.064 * 3 + 0.032 + 0.016 + 0.017 + 0.032) + 0.002
    )
    # base 368 bytes (tied head not counted twice); each rank holds half
    assert base_bytes(spec) == 368
    assert [r.held_bytes for r in serial.ranks] == [184, 184]
    # uneven memory shares: 3:1 of every weight's rows
    uneven = estimate_sharded(spec, devices, [3, 1], [1, 1], work, link, prefetch=True)
    assert uneven.ranks[0].held_bytes > 2.5 * uneven.ranks[1].held_bytes


def test_cost_model_replicas_leave_out_devices_the_model_does_not_fit() -> None:
    """8 layers: 2384 bytes of weights (embedding 80, 288 per layer), 1152 bytes of
    activations per token; 4 tokens. A replica needs 2384 + 2 * 1152 on each of two devices,
    more than the small one's 90% of 3000: mlx-lm runs on the big one alone, exo-tp on both."""
    spec, link = _tiny_spec(8), LinkCost(latency=0.002, bandwidth=1000, measured=False)
    big = Device(name="big", memory=10**6, flops=1000)
    small = Device(name="small", memory=3000, flops=500)
    work = Workload(tokens=4, lora_params=0)
    assert base_bytes(spec) == 2384
    est = estimate_replicas(spec, [big, small], work, link)
    assert [r.device for r in est.ranks] == ["big"] and "small" in est.note
    # forward + backward 2 * 2 FLOPs per weight and token, 8 * 144 + 40 (head) weights
    assert est.step_seconds == pytest.approx(2 * 2 * 4 * (8 * 144 + 40) / 1000)
    sharded = estimate_sharded(spec, [big, small], [3, 1], [2, 1], work, link, prefetch=True)
    assert sharded.fits and sharded.ranks[1].held_bytes < base_bytes(spec) / 3
    assert [r.tokens for r in sharded.ranks] == [3, 1]
