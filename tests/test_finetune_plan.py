"""The pure pieces of `exo-tp finetune`: row cuts, micro-batch shares, the cost model; and the
padded dim-0 all-gather on real ring ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from ring_harness import run_on_ranks

from exo_tp.errors import ExoTpError
from exo_tp.finetune.plan import batch_rows, plan_finetune, split_rows

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
