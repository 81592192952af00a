"""Choosing a plan: which devices, grouped how, hold which layers (pure).

Candidates, for every subset that keeps the fastest k devices (and each group of devices joined
by fast links on its own):

- one uneven TP group of all of them;
- pure pipeline: one device per stage;
- TP groups of devices joined by fast links, chained as stages (a slow link is crossed by one
  hop per token instead of two all_sums per layer);
- homogeneous TP groups: the same, further split into devices of similar speed.

Inside a TP group shares follow decode speed (where devices measured the model's shapes, the
speed each reads its own shard at: `_Layouts.group_tp`). Layers go to stages by the objective:

- latency (one request at a time): stages run one after another, so a layer costs its stage's
  per-layer time wherever the others are, and the fastest stages are filled up to their memory
  first (every stage holds at least one layer); plans are ranked by time per token;
- throughput (many requests at once): the runtime overlaps the stages (one micro-batch each),
  so the slowest stage sets the pace and layers go in proportion to each stage's speed at the
  expected micro-batch (within memory); plans are ranked by aggregate tokens per second.

`resolve_objective` turns ``auto`` into one of them by the observed queue. Each candidate is
priced by `exo_tp.plan.predict`; the best that fits in memory wins, the others are returned as
runner-ups.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, NamedTuple

from pydantic import Field

from exo_tp.arch import table_for
from exo_tp.errors import PlanError
from exo_tp.plan.cluster import Cluster, DeviceCost
from exo_tp.plan.cost import (
    FLOAT_BYTES,
    TOKEN_OVERHEAD_LAYERS,
    all_sum_seconds,
    collective_floor,
    own_read_speed,
    prefill_flops,
    rank_load,
    read_seconds,
)
from exo_tp.plan.draft import DraftCost
from exo_tp.plan.human import size
from exo_tp.plan.kv_width import FLOAT_KV, KvShape
from exo_tp.plan.pipeline import PipelinePlan, Stage, balance_layers
from exo_tp.plan.predict import Prediction, kv_width, predict
from exo_tp.plan.shard_plan import ShardPlan, Span
from exo_tp.plan.spec import Frozen, ModelSpec
from exo_tp.plan.tensor_parallel import plan_tensor_parallel

SIMILAR_SPEED = 1.5  # devices within this decode-speed ratio make a homogeneous group
FAST_LINK = 4.0  # links within this factor of the best latency and bandwidth count as fast

Groups = tuple[tuple[int, ...], ...]
Kind = Literal["single device", "tensor parallel", "pipeline", "hybrid"]
Objective = Literal["latency", "throughput"]
ObjectiveChoice = Literal["latency", "throughput", "auto"]
# Re-weightings of a TP group's shares by the speed each device reads its own shard at (only
# for devices with measured shapes); the best of them is kept, so a step in a device's
# per-byte speed between two shapes cannot make it oscillate into a worse split.
BALANCE_ROUNDS = 4
LOADED_AT = 2  # requests at once (running and waiting) from which auto plans for throughput
DEFAULT_STREAMS = 16  # the load a throughput plan is priced at when none was observed


def resolve_objective(requested: ObjectiveChoice, queue: int) -> tuple[Objective, int, str]:
    """(objective, streams to price it at, why) for ``requested`` with ``queue`` requests
    running or waiting when the plan is made."""
    if requested == "latency":
        return "latency", 1, "latency asked for: one request at a time is fastest"
    if requested == "throughput":
        streams = max(queue, DEFAULT_STREAMS)
        return "throughput", streams, f"throughput asked for: priced at {streams} streams"
    if queue >= LOADED_AT:
        return (
            "throughput",
            queue,
            f"auto: {queue} requests running or waiting (>= {LOADED_AT}), so the slowest "
            "overlapped stage sets the pace",
        )
    return "latency", 1, f"auto: {queue} request(s) running or waiting, so time per token counts"


class Candidate(Frozen):
    groups: Groups  # device indices of each stage, in stage order
    dropped: tuple[int, ...]  # devices left out
    plan: PipelinePlan
    prediction: Prediction

    @property
    def kind(self) -> Kind:
        if len(self.groups) == 1:
            return "single device" if len(self.groups[0]) == 1 else "tensor parallel"
        return "pipeline" if all(len(g) == 1 for g in self.groups) else "hybrid"

    @property
    def devices(self) -> tuple[int, ...]:
        """The device of each global rank."""
        return tuple(d for g in self.groups for d in g)


class Rejected(Frozen):
    groups: Groups
    reason: str


class Choice(Frozen):
    best: Candidate
    alternatives: tuple[Candidate, ...]  # runner-ups, best first
    rejected: tuple[Rejected, ...]
    considered: int = Field(ge=1)
    objective: Objective = "latency"
    streams: int = Field(default=1, ge=1)  # the load throughput was priced at
    reason: str = ""  # why this objective


def _fast_components(cluster: Cluster, devices: Sequence[int]) -> list[tuple[int, ...]]:
    """Devices joined (transitively) by links within FAST_LINK of the best one among them."""
    pairs = [(a, b, cluster.link(a, b)) for i, a in enumerate(devices) for b in devices[i + 1 :]]
    if not pairs:
        return [tuple(devices)]
    best_latency = min(c.latency for _, _, c in pairs)
    best_bandwidth = max(c.bandwidth for _, _, c in pairs)
    parent = {d: d for d in devices}

    def root(d: int) -> int:
        while parent[d] != d:
            parent[d] = parent[parent[d]]
            d = parent[d]
        return d

    for a, b, c in pairs:
        if c.latency <= FAST_LINK * best_latency and c.bandwidth * FAST_LINK >= best_bandwidth:
            parent[root(a)] = root(b)
    groups: dict[int, list[int]] = {}
    for d in devices:  # keeps the caller's (speed) order inside and between groups
        groups.setdefault(root(d), []).append(d)
    return [tuple(g) for g in groups.values()]


def _speed_bands(cluster: Cluster, devices: Sequence[int]) -> list[tuple[int, ...]]:
    """Runs of devices (fastest first) whose speeds are within SIMILAR_SPEED of the run's first."""
    bands: list[list[int]] = []
    for d in devices:
        if (
            bands
            and cluster.devices[bands[-1][0]].speed <= SIMILAR_SPEED * cluster.devices[d].speed
        ):
            bands[-1].append(d)
        else:
            bands.append([d])
    return [tuple(b) for b in bands]


def _structures(
    cluster: Cluster, devices: tuple[int, ...], components: list[tuple[int, ...]]
) -> list[Groups]:
    comps = [c for c in (tuple(d for d in comp if d in devices) for comp in components) if c]
    out: list[Groups] = [(devices,)]
    if len(devices) > 1:
        out.append(tuple((d,) for d in devices))
    out.append(tuple(comps))
    out.append(tuple(band for comp in comps for band in _speed_bands(cluster, comp)))
    return out


def _subsets(cluster: Cluster, components: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    by_speed = tuple(
        sorted(range(len(cluster.devices)), key=lambda d: (-cluster.devices[d].speed, d))
    )
    subsets = [by_speed[:k] for k in range(len(by_speed), 0, -1)]
    subsets += [
        tuple(d for d in by_speed if d in comp) for comp in components if len(components) > 1
    ]
    return subsets


class _StageTerms(NamedTuple):
    per_layer: float  # seconds per layer per token (weight reads and collectives)
    per_row: float  # FLOP-bound seconds per layer per row
    fixed: float  # the stage's ends (embedding, norm, head): weight reads per token
    fixed_row: float  # the ends' FLOP-bound seconds per row
    capacity: int  # layers the stage can hold


class _Layouts:
    """Lays out one grouping: TP shares, layers per stage within memory, exact plan."""

    def __init__(
        self,
        spec: ModelSpec,
        cluster: Cluster,
        context: int,
        prompt: int,
        objective: Objective = "latency",
        streams: int = 1,
        kv: KvShape = FLOAT_KV,
        draft: DraftCost | None = None,
    ):
        self.spec, self.cluster = spec, cluster
        self.context, self.prompt = context, prompt
        self.objective, self.streams, self.kv = objective, streams, kv
        self.draft = draft
        self._tp: dict[tuple[float, ...], ShardPlan] = {}
        self._group_tp: dict[tuple[int, ...], ShardPlan] = {}
        self._terms: dict[tuple[tuple[int, ...], bool, bool], _StageTerms] = {}

    def tp(self, speeds: Sequence[float]) -> ShardPlan:
        key = tuple(round(s / sum(speeds), 12) for s in speeds)  # one-rank plans are all alike
        if key not in self._tp:
            self._tp[key] = plan_tensor_parallel(self.spec, key)
        return self._tp[key]

    def group_tp(self, group: tuple[int, ...]) -> ShardPlan:
        """The TP plan of ``group``: shares by the devices' speeds, then, where some of them
        measured the model's shapes, by the speed each reads its own shard at (a shard's
        slices may read faster or slower per byte than the whole model)."""
        if group not in self._group_tp:
            devices = [self.cluster.devices[d] for d in group]
            plan = self.tp([d.speed for d in devices])
            if len(group) > 1 and any(d.matvec.points for d in devices):
                plan = self._balanced(plan, devices)
            self._group_tp[group] = plan
        return self._group_tp[group]

    def _balanced(self, plan: ShardPlan, devices: Sequence[DeviceCost]) -> ShardPlan:
        """Of ``plan`` and its re-weightings, the one whose weight reads take least."""
        whole = Span(start=0, stop=self.spec.num_layers)
        best, best_seconds = plan, math.inf
        for _ in range(BALANCE_ROUNDS + 1):
            loads = [rank_load(self.spec, s, whole, True, True) for s in plan.ranks]
            seconds = read_seconds(loads, devices)
            if seconds < best_seconds:
                best, best_seconds = plan, seconds
            speeds = [own_read_speed(x, d) for x, d in zip(loads, devices, strict=True)]
            if min(speeds) <= 0:
                break
            plan = self.tp(speeds)
        return best

    def _stage_terms(
        self, group: tuple[int, ...], tp: ShardPlan, first: bool, last: bool
    ) -> _StageTerms:
        key = (group, first, last)
        if key not in self._terms:
            self._terms[key] = self._measure_stage(group, tp, first, last)
        return self._terms[key]

    def _measure_stage(
        self, group: tuple[int, ...], tp: ShardPlan, first: bool, last: bool
    ) -> _StageTerms:
        spec, n = self.spec, self.spec.num_layers
        devices: list[DeviceCost] = [self.cluster.devices[d] for d in group]
        every = [rank_load(spec, s, Span(start=0, stop=n), False, False) for s in tp.ranks]
        ends = [rank_load(spec, s, Span(start=0, stop=0), first, last) for s in tp.ranks]
        overhead = max(d.layer_overhead for d in devices)
        per_layer = read_seconds(every, devices) / n + overhead
        per_row = max(
            prefill_flops(x, 1) / n / d.prefill_flops for x, d in zip(every, devices, strict=True)
        )
        fixed = read_seconds(ends, devices) + (TOKEN_OVERHEAD_LAYERS * overhead if last else 0.0)
        fixed_row = max(
            prefill_flops(end, 1) / d.prefill_flops for end, d in zip(ends, devices, strict=True)
        )
        link = self.cluster.ring_link(group)
        collectives = 0.0
        if link is not None:
            one = all_sum_seconds(len(group), spec.hidden_size * FLOAT_BYTES, link)
            reduces = 3 if spec.dense_mlp_with_experts else 2  # Gemma 4 MoE: MLP, experts
            collectives = reduces * (one + collective_floor(len(group), link, overhead))
            if spec.moe_latent_norm:  # Kimi K3: the routed latent sum before its norm
                latent = all_sum_seconds(len(group), spec.moe_latent * FLOAT_BYTES, link)
                collectives += latent + collective_floor(len(group), link, overhead)
            # full-width q/k norms: one more all-reduce each per layer, latency-bound
            norms = len(table_for(spec.model_type).norms)
            tiny = all_sum_seconds(len(group), FLOAT_BYTES, link)
            collectives += norms * (tiny + collective_floor(len(group), link, overhead))
        # the last stage's first rank conducts, and holds the draft model beside its layers
        beside = [0] * len(devices)
        if last and self.draft is not None:
            beside[0] = self.draft.bytes_at(self.context)
        if first:  # the first stage's first rank runs a vision tower (exo_tp.plan.vision)
            beside[0] += spec.vision_bytes
        if last:  # every rank of the last stage holds the MTP heads (exo_tp.plan.mtp)
            beside = [b + spec.mtp_bytes for b in beside]
        capacity = min(
            math.floor(
                (d.memory - end.held_bytes - extra)
                / (
                    (
                        x.held_bytes
                        + self.kv.streams * (kv_width(x, self.kv) * self.context + x.state_bytes)
                    )
                    / n
                )
            )
            for x, end, d, extra in zip(every, ends, devices, beside, strict=True)
        )
        return _StageTerms(per_layer + collectives, per_row, fixed, fixed_row, capacity)

    def layout(self, groups: Groups, dropped: tuple[int, ...]) -> Candidate | Rejected:
        spec, layers = self.spec, self.spec.num_layers
        if len(groups) > layers:
            return Rejected(groups=groups, reason=f"{len(groups)} stages for {layers} layers")
        table = table_for(spec.model_type)
        if len(groups) > 1 and not table.stages:
            return Rejected(groups=groups, reason=f"no pipeline stages for {spec.model_type}")
        if not table.split and any(len(g) > 1 for g in groups):
            return Rejected(groups=groups, reason=f"no tensor-parallel table for {spec.model_type}")
        tps = [self.group_tp(g) for g in groups]
        terms = [
            self._stage_terms(g, tp, i == 0, i == len(groups) - 1)
            for i, (g, tp) in enumerate(zip(groups, tps, strict=True))
        ]
        caps = [t.capacity for t in terms]
        if min(caps) < 1:
            short = groups[caps.index(min(caps))]
            return Rejected(groups=groups, reason=f"devices {list(short)} cannot hold a layer")
        order = sorted(range(len(groups)), key=lambda i: terms[i].per_layer)
        rows = -(-self.streams // len(groups))  # one micro-batch per stage
        # A stage's time under load for its micro-batch of rows: its ends, then per layer.
        fixed = [max(t.fixed, rows * t.fixed_row) for t in terms]
        per_layer = [max(t.per_layer, rows * t.per_row) for t in terms]
        devices = tuple(d for g in groups for d in g)
        # Capacities come from an average layer; a stage whose real layers (dense vs MoE) do
        # not fit gives one back and the fill runs again.
        for _ in range(len(groups) + 4):
            if self.objective == "throughput":
                counts = balance_layers(layers, caps, fixed, per_layer)
            else:
                counts = _fill(layers, caps, order)
            if counts is None:
                return Rejected(
                    groups=groups, reason=f"memory holds {sum(caps)} of {layers} layers"
                )
            plan = _pipeline(spec, tps, counts)
            prediction = predict(
                plan,
                devices,
                self.cluster,
                self.context,
                self.prompt,
                self.streams,
                self.kv,
                self.draft,
            )
            over = prediction.overflow()
            if over is None:
                return Candidate(groups=groups, dropped=dropped, plan=plan, prediction=prediction)
            stage = plan.locate(over.rank)[0]
            if counts[stage] == 1:
                break
            caps[stage] = counts[stage] - 1
        assert over is not None  # every pass that fits returns: the loop ends on an overflow
        return Rejected(
            groups=groups,
            reason=(
                f"{self.cluster.devices[over.device].name} needs {size(over.total)}, "
                f"has {size(over.limit)}"
            ),
        )


def _fill(layers: int, caps: Sequence[int], order: Sequence[int]) -> list[int] | None:
    """One layer per stage, then the rest to stages in ``order``, each up to its cap."""
    counts = [1] * len(caps)
    left = layers - len(caps)
    for i in order:
        add = min(caps[i] - 1, left)
        counts[i] += add
        left -= add
    return None if left else counts


def _pipeline(spec: ModelSpec, tps: Sequence[ShardPlan], counts: Sequence[int]) -> PipelinePlan:
    stages, rank, start = [], 0, 0
    for tp, count in zip(tps, counts, strict=True):
        stages.append(
            Stage(
                ranks=tuple(range(rank, rank + tp.size)),
                layers=Span(start=start, stop=start + count),
                tp=tp,
            )
        )
        rank, start = rank + tp.size, start + count
    return PipelinePlan(spec=spec, stages=tuple(stages))


def choose_plan(
    spec: ModelSpec,
    cluster: Cluster,
    context_tokens: int | None = None,
    prompt_tokens: int = 512,
    keep: int = 5,
    objective: ObjectiveChoice = "latency",
    queue: int = 0,
    kv: KvShape = FLOAT_KV,
    draft: DraftCost | None = None,
) -> Choice:
    """The best plan of ``spec`` on ``cluster`` for ``objective`` that fits, and up to ``keep``
    runner-ups (``queue``: requests running or waiting, which ``auto`` goes by; ``draft``: a
    draft model the conductor holds where a plan speculates).

    ``context_tokens`` defaults to the model's context length, whose KV cache must fit too.
    """
    context = spec.context_length if context_tokens is None else context_tokens
    chosen, streams, reason = resolve_objective(objective, queue)
    layouts = _Layouts(spec, cluster, context, prompt_tokens, chosen, streams, kv, draft)
    components = _fast_components(cluster, range(len(cluster.devices)))
    everyone = set(range(len(cluster.devices)))
    seen: set[Groups] = set()
    candidates: list[Candidate] = []
    rejected: list[Rejected] = []
    for subset in _subsets(cluster, components):
        dropped = tuple(sorted(everyone - set(subset)))
        for groups in _structures(cluster, subset, components):
            if groups in seen:
                continue
            seen.add(groups)
            result = layouts.layout(groups, dropped)
            if isinstance(result, Candidate):
                candidates.append(result)
            else:
                rejected.append(result)
    if not candidates:
        reasons = sorted({r.reason for r in rejected}, key=len)
        raise PlanError("no plan fits: " + "; ".join(reasons[:3]))
    if chosen == "throughput":
        ranked = sorted(
            candidates, key=lambda c: (-c.prediction.loaded_tokens_per_second, len(c.devices))
        )
    else:
        ranked = sorted(candidates, key=lambda c: (c.prediction.decode_seconds, len(c.devices)))
    best = ranked[0]
    explained = best.prediction.model_copy(update={"objective": chosen, "reason": reason})
    return Choice(
        best=best.model_copy(update={"prediction": explained}),
        alternatives=tuple(ranked[1 : keep + 1]),
        rejected=tuple(rejected),
        considered=len(seen),
        objective=chosen,
        streams=streams,
        reason=reason,
    )
