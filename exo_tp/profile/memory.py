"""Memory read bandwidth: how fast MLX streams a large array it only reads.

A column reduction (summing the rows of a (rows, 4096) view) vectorises on every backend, so it
is limited by memory, not by a sequential chain of float additions as a full `sum` is on CPU
(2.8 GB/s there against 10 GB/s for the column reduction on the same array).
"""

from __future__ import annotations

import mlx.core as mx

from exo_tp.profile.timing import mean_seconds

ROW = 4096


def read_bandwidth(data: mx.array, min_seconds: float) -> float:
    """Bytes/s of reading the 1-D ``data`` (make it far larger than the CPU caches), over at
    least ``min_seconds`` of wall time."""
    rows = data[: data.size // ROW * ROW].reshape(-1, ROW)
    mx.eval(rows)
    return rows.nbytes / mean_seconds(lambda: mx.eval(rows.sum(axis=0)), min_seconds)
