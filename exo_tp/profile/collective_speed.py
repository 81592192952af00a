"""Timing the MLX collectives of a formed group (every rank calls the same functions in the same
order): all_sum latency of 4 KB, all_sum payload rate of 8 MB, and one-way send/recv latency
between ring neighbours (half a ping-pong round trip). Medians, after one warm-up each."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import mlx.core as mx

from exo_tp.wire.profiles import LinkProfile, measured_now

SMALL_BYTES = 4 * 1024
LARGE_BYTES = 8 * 1024 * 1024


def median_seconds(step: Callable[[], object], repeats: int) -> float:
    step()  # warm-up: first use of the connection, allocations
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def all_sum_speed(
    group: mx.distributed.Group, small_repeats: int, large_repeats: int
) -> tuple[float, float]:
    """(seconds of a 4 KB all_sum, payload bytes/s of an 8 MB all_sum) over the whole group."""
    small, large = mx.ones(SMALL_BYTES // 4), mx.ones(LARGE_BYTES // 4)
    mx.eval(small, large)
    latency = median_seconds(
        lambda: mx.eval(mx.distributed.all_sum(small, group=group)), small_repeats
    )
    large_seconds = median_seconds(
        lambda: mx.eval(mx.distributed.all_sum(large, group=group)), large_repeats
    )
    return latency, LARGE_BYTES / large_seconds


def round_trip(group: mx.distributed.Group, a: int, b: int, repeats: int) -> float | None:
    """Median round trip of 4 KB from rank ``a`` to its ring neighbour ``b`` and back, as seen
    by either end (``b`` times the interval between two arrivals: also one round trip); None on
    ranks not in the pair, which return at once."""
    me = group.rank()
    if me not in (a, b):
        return None
    x = mx.ones(SMALL_BYTES // 4)
    mx.eval(x)
    stamps = []
    for _ in range(repeats + 1):
        if me == a:  # send, then wait for the echo
            stamps.append(time.perf_counter())
            mx.eval(mx.distributed.send(x, b, group=group))
            mx.eval(mx.distributed.recv_like(x, b, group=group))
        else:  # echo
            y = mx.distributed.recv_like(x, a, group=group)
            mx.eval(y)
            stamps.append(time.perf_counter())
            mx.eval(mx.distributed.send(y, a, group=group))
    if me == a:
        stamps.append(time.perf_counter())
    # the first interval includes the warm-up; the rest are round trips
    return statistics.median(
        later - earlier for earlier, later in zip(stamps[1:], stamps[2:], strict=False)
    )


def ring_pairs(size: int) -> list[tuple[int, int]]:
    """Neighbouring ranks of a ring (send/recv reach only those): (0,1), (1,2) ... (n-1,0)."""
    if size < 2:
        return []
    return [(0, 1)] if size == 2 else [(r, (r + 1) % size) for r in range(size)]


def neighbour_latencies(group: mx.distributed.Group, repeats: int) -> dict[tuple[int, int], float]:
    """One-way send/recv seconds of each ring pair this rank is in, pair by pair (the others
    wait, so pairs never share a CPU or socket)."""
    out = {}
    for a, b in ring_pairs(group.size()):
        seconds = round_trip(group, a, b, repeats)
        if seconds is not None:
            out[(a, b)] = seconds / 2
    return out


def group_links(
    group: mx.distributed.Group,
    names: Sequence[str],
    small_repeats: int = 10,
    large_repeats: int = 3,
) -> list[LinkProfile]:
    """The links of a formed group that this rank measured (it starts their ping-pong), named
    ``names[rank]``; all_sum figures are the whole group's. About 0.1 s on loopback."""
    if group.size() < 2:
        return []
    latency, bandwidth = all_sum_speed(group, small_repeats, large_repeats)
    return [
        LinkProfile(
            a=names[a],
            b=names[b],
            up=True,
            all_sum_latency=latency,
            all_sum_bandwidth=bandwidth,
            send_recv_latency=one_way,
            group_size=group.size(),
            source="epoch",
            measured_at=measured_now(),
        )
        for (a, b), one_way in neighbour_latencies(group, small_repeats).items()
        if a == group.rank()
    ]
