"""One group or replicas: for one model and an objective, the planner compares one group over
the usable devices with k replicas over disjoint subsets of them (pure).

Tensor parallelism lowers one stream's time per token; replicas serve more streams at once,
since each holds the whole model and none waits on the others' collectives. Which wins depends
on the load, the links and how unequal the devices are, so each layout is priced by the same
cost model as a single plan (`exo_tp.plan.search.choose_plan` on each replica's devices):

- latency (one request at a time): the fastest replica's time per token; a router sends a lone
  request there, so one group over every device usually wins unless the links are slow;
- throughput (many streams): every replica's tokens per second together, with the streams
  spread as a router would (each next stream where it adds the most, `_spread`).

Devices go to replicas by speed (each next fastest to the replica with the least speed so far),
so replicas come out about equal; a replica whose devices cannot hold the model rules its
layout out (its reason kept).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from pydantic import Field

from exo_tp.errors import PlanError
from exo_tp.plan.cluster import Cluster
from exo_tp.plan.draft import DraftCost
from exo_tp.plan.kv_width import FLOAT_KV, KvShape
from exo_tp.plan.predict import Prediction
from exo_tp.plan.search import Choice, Objective, ObjectiveChoice, choose_plan, resolve_objective
from exo_tp.plan.spec import Frozen, ModelSpec

Subsets = tuple[tuple[int, ...], ...]


class Replicas(Frozen):
    """One layout of a model: ``len(subsets)`` replicas (1: one group)."""

    subsets: Subsets  # the cluster's device indices each replica may use
    choices: tuple[Choice, ...]  # each replica's plan, in its subset's own indices
    streams: tuple[int, ...]  # streams a router would give each at the priced load
    tokens_per_second: float = Field(ge=0)  # every replica's together at that load
    decode_seconds: float = Field(gt=0)  # one request alone, on the fastest replica

    def devices(self, replica: int) -> tuple[int, ...]:
        """The cluster's device of each global rank of ``replica``."""
        subset = self.subsets[replica]
        return tuple(subset[d] for d in self.choices[replica].best.devices)

    def memory(self) -> dict[int, int]:
        """Bytes each device of the cluster holds for this layout (weights, KV, tower)."""
        held: dict[int, int] = {}
        for replica, choice in enumerate(self.choices):
            for rank in choice.best.prediction.memory:
                device = self.subsets[replica][rank.device]
                held[device] = held.get(device, 0) + rank.total
        return held


class ReplicaChoice(Frozen):
    best: Replicas
    options: tuple[Replicas, ...]  # every layout that fits, best first
    rejected: tuple[tuple[int, str], ...] = ()  # (replicas, why none fits)
    objective: Objective = "latency"
    streams: int = Field(default=1, ge=1)  # the load it was priced at
    reason: str = ""  # why this layout, in words


def sub_cluster(cluster: Cluster, devices: Sequence[int]) -> Cluster:
    """``cluster`` restricted to ``devices`` (re-indexed in that order), with their links."""
    index = {d: i for i, d in enumerate(devices)}
    links = tuple(
        link.model_copy(update={"a": index[link.a], "b": index[link.b]})
        for link in cluster.links
        if link.a in index and link.b in index
    )
    return Cluster(
        devices=tuple(cluster.devices[d] for d in devices),
        links=links,
        default_link=cluster.default_link,
    )


def split_devices(cluster: Cluster, count: int) -> Subsets:
    """``count`` disjoint subsets of about equal total speed: each device, fastest first, to
    the subset with the least speed so far."""
    order = sorted(range(len(cluster.devices)), key=lambda d: -cluster.devices[d].speed)
    subsets: list[list[int]] = [[] for _ in range(count)]
    speeds = [0.0] * count
    for d in order:
        slot = min(range(count), key=lambda s: (speeds[s], s))
        subsets[slot].append(d)
        speeds[slot] += cluster.devices[d].speed
    return tuple(tuple(sorted(s)) for s in subsets)


def _at(prediction: Prediction, streams: int) -> float:
    if streams == 0:
        return 0.0
    return prediction.model_copy(update={"streams": streams}).loaded_tokens_per_second


def _spread(predictions: Sequence[Prediction], streams: int) -> tuple[int, ...]:
    """Streams per replica as a least-loaded router spreads them: each next stream where it
    adds the most tokens per second (the fastest replica when all are idle)."""
    given = [0] * len(predictions)
    for _ in range(streams):
        gains = [_at(p, n + 1) - _at(p, n) for p, n in zip(predictions, given, strict=True)]
        # equal gains (every replica saturated, or alike): the least loaded, as a router does
        best = max(gains)
        equal = [i for i, g in enumerate(gains) if g >= best - 1e-9 * max(1.0, abs(best))]
        given[min(equal, key=lambda i: (given[i], i))] += 1
    return tuple(given)


class _Pricing(NamedTuple):
    """What every replica's plan is priced with (`choose_plan`'s arguments)."""

    context_tokens: int | None
    objective: Objective
    streams: int
    kv: KvShape
    draft: DraftCost | None

    def choose(self, spec: ModelSpec, cluster: Cluster) -> Choice:
        queue = self.streams if self.objective == "throughput" else 0
        return choose_plan(
            spec,
            cluster,
            context_tokens=self.context_tokens,
            objective=self.objective,
            queue=queue,
            kv=self.kv,
            draft=self.draft,
        )


def _layout(spec: ModelSpec, cluster: Cluster, subsets: Subsets, pricing: _Pricing) -> Replicas:
    choices = tuple(pricing.choose(spec, sub_cluster(cluster, s)) for s in subsets)
    predictions = [c.best.prediction for c in choices]
    given = _spread(predictions, pricing.streams)
    return Replicas(
        subsets=subsets,
        choices=choices,
        streams=given,
        tokens_per_second=sum(_at(p, n) for p, n in zip(predictions, given, strict=True)),
        decode_seconds=min(p.decode_seconds for p in predictions),
    )


def _reason(
    best: Replicas, single: Replicas | None, objective: Objective, streams: int, names: list[str]
) -> str:
    def said(r: Replicas) -> str:
        if objective == "throughput":
            return f"{r.tokens_per_second:.1f} tokens/s together at {streams} streams"
        return f"{1000 * r.decode_seconds:.1f} ms a token alone"

    count = len(best.subsets)
    if count == 1:
        return f"one group: {said(best)}"
    what = f"{count} replicas over " + " and ".join(
        "{" + ", ".join(names[d] for d in s) + "}" for s in best.subsets
    )
    if single is None:
        return f"{what}: {said(best)} (no single group fits)"
    return f"{what}: {said(best)}, against {said(single)} for one group"


def choose_replicas(
    spec: ModelSpec,
    cluster: Cluster,
    objective: ObjectiveChoice = "latency",
    queue: int = 0,
    context_tokens: int | None = None,
    max_replicas: int | None = None,
    kv: KvShape = FLOAT_KV,
    draft: DraftCost | None = None,
) -> ReplicaChoice:
    """The best of one group and 2 .. ``max_replicas`` replicas (default: one per device) of
    ``spec`` on ``cluster`` for ``objective`` (``auto``: by ``queue``, as `choose_plan`)."""
    chosen, streams, why = resolve_objective(objective, queue)
    pricing = _Pricing(context_tokens, chosen, streams, kv, draft)
    most = len(cluster.devices) if max_replicas is None else min(max_replicas, len(cluster.devices))
    options: list[Replicas] = []
    rejected: list[tuple[int, str]] = []
    for count in range(1, most + 1):
        try:
            options.append(_layout(spec, cluster, split_devices(cluster, count), pricing))
        except PlanError as error:
            rejected.append((count, str(error)))
    if not options:
        raise PlanError(rejected[0][1])
    if chosen == "throughput":
        options.sort(key=lambda r: (-r.tokens_per_second, len(r.subsets)))
    else:
        options.sort(key=lambda r: (r.decode_seconds, len(r.subsets)))
    single = next((r for r in options if len(r.subsets) == 1), None)
    names = [d.name for d in cluster.devices]
    return ReplicaChoice(
        best=options[0],
        options=tuple(options),
        rejected=tuple(rejected),
        objective=chosen,
        streams=streams,
        reason=f"{why}; {_reason(options[0], single, chosen, streams, names)}",
    )
