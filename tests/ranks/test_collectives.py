"""Equal-shape collective helpers on real ring ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from ring_harness import run_on_ranks

GATHER = """
import json
from exo_tp.shard.collectives import gather_padded, broadcast_from_first
sizes = {sizes}
r = group.rank()
# rank r sends values r*1000 + (0..size-1) on 2 rows
mine = mx.stack([mx.arange(sizes[r]) + 1000 * r, mx.arange(sizes[r]) - 1000 * r]).astype(mx.float32)
full = gather_padded(mine, sizes, group)
# a second collective right after: a corrupted stream would show here
b = broadcast_from_first(mx.array([7.0 + r, 1.0]), group)
mx.eval(full, b)
if r == 0:
    json.dump({{"full": full.tolist(), "b": b.tolist()}}, open(OUT, "w"))
"""


@pytest.mark.parametrize("sizes", [[5, 0, 3], [1, 4, 2, 7], [3, 3]])
def test_gather_padded_concatenates_uneven_shards(tmp_path: Path, sizes: list[int]) -> None:
    out = run_on_ranks(len(sizes), GATHER.format(sizes=sizes), tmp_path)
    expect_top = [1000 * r + i for r, s in enumerate(sizes) for i in range(s)]
    expect_bottom = [i - 1000 * r for r, s in enumerate(sizes) for i in range(s)]
    assert out["full"] == [expect_top, expect_bottom]
    assert out["b"] == [7.0, 1.0]


def test_shape_mismatch_is_caught_before_sending(tmp_path: Path) -> None:
    script = """
import json
from exo_tp.shard.collectives import CollectiveShapeError, sum_over_ranks
try:
    sum_over_ranks(mx.zeros((1, 5)), 6, group)
    caught = False
except CollectiveShapeError:
    caught = True
if group.rank() == 0:
    json.dump({"caught": caught}, open(OUT, "w"))
"""
    assert run_on_ranks(2, script, tmp_path)["caught"] is True
