"""Seconds of a plan's collectives and pipeline hops (pure).

Collectives are priced by a ring model fitted to the 2-rank link measurements of `exo-tp bench`
(L: all_sum latency of 4 KB, B: all_sum payload rate of 8 MB). A ring step moving s bytes costs
L/2 + s/B (a 2-rank all_sum is two such steps of b/2):

    all_sum of b bytes over n ranks:        2(n-1) steps of b/n  =  (n-1) L + 2(n-1)/n * b/B
    all_gather of p bytes from each rank:   (n-1) steps of p     =  (n-1) (L/2 + p/B)

A pipeline hop (TCP, `exo_tp.runtime.pipeline`) of b bytes to k ranks costs
HOP_OVERHEAD + L + k * b/B. A collective also costs at least COLLECTIVE_OVERHEAD_LAYERS of a
layer's overhead (handing the stream over and waking the ring threads inside a graph), or its
link's latency where that is larger: both figures estimate one cost, and the link probe's
in-graph figure sees it all on some machines and little of it on others.
"""

from __future__ import annotations

from pydantic import Field

from exo_tp.frozen import Frozen
from exo_tp.plan.profiles import FLOAT_BYTES
from exo_tp.plan.shard_plan import Collective, ShardPlan

# What a hop adds beyond its link: the receiving rank waits blocked on a socket (it must not
# spin) and wakes on the scheduler's next tick. bench/pipeline_hop.py measured 8.0 ms per token
# for a 2-stage pipeline over plain mlx-lm (two hops) against an 18 µs raw one-way hop.
HOP_OVERHEAD = 4e-3
# A collective costs at least half of one layer's overhead: measured directly (a 2-rank decode
# with its all_sums and a build without them) at 0.17 ms on a VM whose layers cost 0.34 ms and
# whose link probe saw 56-60 us in a graph, and at ~0.4 ms on a noisier VM whose layers cost
# 0.5-0.8 ms and whose probe saw 180-460 us. The model first added 0.65 of a layer to the
# probe's figure: it priced the second VM's collectives at twice their cost.
COLLECTIVE_OVERHEAD_LAYERS = 0.5
# Collectives that run once per forward on the first / last stage only.
FIRST_STAGE_COLLECTIVES = frozenset({"embedding", "per_layer_embedding"})
LAST_STAGE_COLLECTIVES = frozenset({"logits"})


class LinkCost(Frozen):
    # seconds of a 2-rank all_sum of a small (4 KB) message, inside a compute graph if measured
    latency: float = Field(gt=0)
    bandwidth: float = Field(gt=0)  # payload bytes/s of a large (8 MB) 2-rank all_sum
    measured: bool


# Assumed when no link was measured: a switched LAN, ~200 us per small all_sum, 1 GB/s.
DEFAULT_LINK = LinkCost(latency=200e-6, bandwidth=1e9, measured=False)


def _per_forward(
    plan: ShardPlan, layers: int, first: bool, last: bool
) -> list[tuple[Collective, int]]:
    """Each collective of a TP group over ``layers`` and how often it runs per forward."""
    counted = []
    for c in plan.collectives:
        if c.per_layer:
            times = c.per_layer * layers
        elif c.name in FIRST_STAGE_COLLECTIVES:
            times = int(first)
        elif c.name in LAST_STAGE_COLLECTIVES:
            times = int(last)
        else:
            times = 1
        if times:
            counted.append((c, times))
    return counted


def collective_count(plan: ShardPlan, layers: int, first: bool, last: bool) -> int:
    """Collectives a TP group runs per forward over ``layers``."""
    return sum(times for _, times in _per_forward(plan, layers, first, last))


def all_sum_seconds(ranks: int, nbytes: float, link: LinkCost) -> float:
    if ranks < 2:
        return 0.0
    return (ranks - 1) * link.latency + 2 * (ranks - 1) / ranks * nbytes / link.bandwidth


def collective_floor(ranks: int, link: LinkCost, layer_overhead: float) -> float:
    """What each collective costs beyond its link model: the part of COLLECTIVE_OVERHEAD_LAYERS
    of a layer's overhead that the link's latency does not already account for."""
    if ranks < 2:
        return 0.0
    return max(0.0, COLLECTIVE_OVERHEAD_LAYERS * layer_overhead - (ranks - 1) * link.latency)


def all_gather_seconds(ranks: int, nbytes_per_rank: float, link: LinkCost) -> float:
    if ranks < 2:
        return 0.0
    return (ranks - 1) * (link.latency / 2 + nbytes_per_rank / link.bandwidth)


def hop_seconds(nbytes: float, receivers: int, link: LinkCost) -> float:
    return HOP_OVERHEAD + link.latency + receivers * nbytes / link.bandwidth


def collective_seconds(
    plan: ShardPlan,
    layers: int,
    first: bool,
    last: bool,
    link: LinkCost,
    tokens: int = 1,
    float_bytes: int = FLOAT_BYTES,
) -> float:
    """Seconds a TP group over ``layers`` spends in its collectives for ``tokens`` at once."""
    total = 0.0
    for c, times in _per_forward(plan, layers, first, last):
        # Logits are gathered for the last position only, prompt or not.
        payload = c.padded * float_bytes * (1 if c.name in LAST_STAGE_COLLECTIVES else tokens)
        one = (
            all_sum_seconds(plan.size, payload, link)
            if c.op == "all_sum"
            else all_gather_seconds(plan.size, payload, link)
        )
        total += times * one
    return total
