"""One link's measurement, run as a child process on both nodes of a pair (2-rank MLX ring).

The parent (`exo_tp.profile.links`) kills this process at its deadline: a ring connect retries
for ~31 s and accept() has no timeout, so an absent peer must never be waited on in-process.
Reports one `LinkMeasurement` to its supervisor (`exo_tp.process`): all_sum latency (4 KB),
all_sum bandwidth (8 MB payload bytes/s), one-way send/recv latency (half a ping-pong round
trip) and what an all_sum adds to a decode step inside a compute graph
(`exo_tp.profile.in_graph`), medians.
"""

from __future__ import annotations

import argparse
from typing import Annotated, Literal

import mlx.core as mx
from pydantic import Field, TypeAdapter

from exo_tp.frozen import Frozen
from exo_tp.process.child import SupervisorLink, run_child
from exo_tp.process.lifecycle import die_with_parent
from exo_tp.process.messages import ChildResult, Failed, Hello
from exo_tp.profile.collective_speed import all_sum_speed, neighbour_latencies
from exo_tp.profile.in_graph import all_sum_in_graph
from exo_tp.transport.ring import barrier, init_ring

REPEATS = {True: (20, 3), False: (100, 8)}  # (small-message repeats, 8 MB repeats)


class LinkMeasurement(Frozen):
    """What the probe reports to its parent (seconds, bytes/s)."""

    all_sum_latency: float
    all_sum_bandwidth: float
    send_recv_latency: float
    all_sum_in_graph: float


class Measured(ChildResult):
    kind: Literal["result"] = "result"
    measurement: LinkMeasurement


ProbeEvent = Annotated[Hello | Failed | Measured, Field(discriminator="kind")]
PROBE_EVENTS: TypeAdapter[Hello | Failed | Measured] = TypeAdapter(ProbeEvent)


def measure(group: mx.distributed.Group, quick: bool) -> LinkMeasurement:
    small_n, large_n = REPEATS[quick]
    latency, bandwidth = all_sum_speed(group, small_n, large_n)
    one_way = neighbour_latencies(group, small_n)[(0, 1)]
    return LinkMeasurement(
        all_sum_latency=latency,
        all_sum_bandwidth=bandwidth,
        send_recv_latency=one_way,
        all_sum_in_graph=all_sum_in_graph(group, quick),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    die_with_parent()

    def probe(link: SupervisorLink) -> None:
        group = init_ring()
        result = measure(group, args.quick)
        barrier(group)
        link.send(Measured(measurement=result))

    run_child(probe)


if __name__ == "__main__":
    main()
