"""One link's measurement, run as a child process on both nodes of a pair (2-rank MLX ring).

The parent (`exo_tp.profile.links`) kills this process at its deadline: a ring connect retries
for ~31 s and accept() has no timeout, so an absent peer must never be waited on in-process.
Prints one JSON object on stdout: all_sum latency (4 KB), all_sum bandwidth (8 MB payload
bytes/s) and one-way send/recv latency (half a ping-pong round trip), medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import mlx.core as mx

from exo_tp.runtime.lifecycle import die_with_parent
from exo_tp.runtime.ring import barrier, init_ring

SMALL_BYTES = 4 * 1024
LARGE_BYTES = 8 * 1024 * 1024
REPEATS = {True: (20, 3), False: (100, 8)}  # (small-message repeats, 8 MB repeats)


def _median_seconds(step: Callable[[], object], repeats: int) -> float:
    step()  # warm-up: first use of the connection
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _ping_pong(group: mx.distributed.Group, x: mx.array, repeats: int) -> float:
    """Round-trip seconds of a small message to the neighbour and back (median)."""
    peer = 1 - group.rank()
    stamps = []
    for _ in range(repeats + 1):
        if group.rank() == 0:  # send, then wait for the echo
            stamps.append(time.perf_counter())
            mx.eval(mx.distributed.send(x, peer, group=group))
            mx.eval(mx.distributed.recv_like(x, peer, group=group))
        else:  # echo; the time between two arrivals is also one round trip
            y = mx.distributed.recv_like(x, peer, group=group)
            mx.eval(y)
            stamps.append(time.perf_counter())
            mx.eval(mx.distributed.send(y, peer, group=group))
    if group.rank() == 0:
        stamps.append(time.perf_counter())
    return statistics.median(b - a for a, b in zip(stamps[1:], stamps[2:], strict=False))


def measure(group: mx.distributed.Group, quick: bool) -> dict[str, float]:
    small_n, large_n = REPEATS[quick]
    small = mx.ones(SMALL_BYTES // 4)
    large = mx.ones(LARGE_BYTES // 4)
    mx.eval(small, large)
    latency = _median_seconds(
        lambda: mx.eval(mx.distributed.all_sum(small, group=group)), small_n)
    large_seconds = _median_seconds(
        lambda: mx.eval(mx.distributed.all_sum(large, group=group)), large_n)
    round_trip = _ping_pong(group, small, small_n)
    return {"all_sum_latency": latency, "all_sum_bandwidth": LARGE_BYTES / large_seconds,
            "send_recv_latency": round_trip / 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    die_with_parent()
    group = init_ring()
    result = measure(group, args.quick)
    barrier(group)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
