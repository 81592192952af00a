"""Predicted decode and prefill time and memory of a pipeline plan on a cluster (pure).

One request at a time: the stages run one after another for every token, so a token costs the
sum over stages of (slowest rank's compute + the stage's collectives), plus the hops: the last
stage sends the sampled token to stage 0 and every stage its hidden state to the next. A prompt
is the same with ``prompt_tokens`` rows at once and compute priced by FLOPs.

Under load (``streams`` requests at once) the runtime splits the batch into one micro-batch per
stage and every stage works at once (overlapped stages), so the slowest stage sets the pace: a
round in which every stream gains a token lasts the longer of one micro-batch's trip through
all stages and (micro-batches x the slowest stage's time for one). A stage's time for b rows is
the larger of its weight reads and b rows' FLOPs, plus its collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import ConfigDict, computed_field

from exo_tp.arch import table_for
from exo_tp.plan.cluster import Cluster
from exo_tp.plan.cost import (
    FLOAT_BYTES,
    TOKEN_BYTES,
    TOKEN_OVERHEAD_LAYERS,
    LinkCost,
    RankLoad,
    collective_count,
    collective_floor,
    collective_seconds,
    hop_seconds,
    prefill_flops,
    rank_load,
    read_seconds,
)
from exo_tp.plan.draft import DraftCost, draft_rank
from exo_tp.plan.kv_width import FLOAT_KV, KvShape, kv_bytes_at_width, tokens_beside_weights
from exo_tp.plan.pipeline import PipelinePlan, Stage
from exo_tp.plan.spec import Frozen, ModelSpec
from exo_tp.plan.vision import tower_rank


class RankMemory(Frozen):
    rank: int
    device: int
    weights: int  # bytes
    kv_cache: int  # bytes for the context (every planned stream's)
    limit: int  # bytes the device allows
    kv_per_token: int = 0  # KV bytes per token of one stream's context, at the planned width
    state: int = 0  # recurrent state bytes per stream
    streams: int = 1  # streams the KV cache is planned for
    # a draft model held beside this rank's shard (the conductor's: exo_tp.plan.draft), its
    # weights and its KV cache for the context
    draft: int = 0
    tower: int = 0  # a vision tower held beside this rank's shard (exo_tp.plan.vision)
    mtp: int = 0  # the checkpoint's MTP heads held beside it (the last stage's, exo_tp.plan.mtp)

    @property
    def context_fits(self) -> int | None:
        """Tokens of context per stream this rank's memory holds beside its weights (None:
        its KV does not grow with the context)."""
        tokens = tokens_beside_weights(
            self.limit - self.draft - self.tower - self.mtp,
            self.weights,
            self.kv_per_token,
            self.state,
            self.streams,
        )
        return None if tokens is None else tokens // self.streams

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.draft + self.tower + self.mtp

    @property
    def fits(self) -> bool:
        return self.total <= self.limit


class StageCost(Frozen):
    devices: tuple[int, ...]
    layers: tuple[int, int]  # [start, stop)
    # per token: weight reads (each segment between collectives waits for its slowest rank)
    # and the per-layer overhead
    compute_seconds: float
    collective_seconds: float  # per token
    prefill_seconds: float  # the whole prompt: compute and collectives
    link: LinkCost | None  # the ring's slowest link (None: one rank)
    row_seconds: float = 0.0  # per token: the slowest rank's FLOPs of one row at decode
    # The model runs a batch one sequence at a time (ArchTable.batch_by_sequence): every row
    # reads the weights and runs the collectives again.
    per_sequence: bool = False

    @property
    def seconds(self) -> float:
        return self.compute_seconds + self.collective_seconds

    def batch_seconds(self, rows: int) -> float:
        """One decode step of ``rows`` sequences: weight reads or FLOPs, whichever binds."""
        if self.per_sequence:
            return rows * self.seconds
        return max(self.compute_seconds, rows * self.row_seconds) + self.collective_seconds


class Prediction(Frozen):
    # Dumps carry the computed totals for readers; reading a dump back ignores them.
    model_config = ConfigDict(frozen=True, extra="ignore")

    stages: tuple[StageCost, ...]
    hop_seconds: float  # per decoded token
    prefill_hop_seconds: float
    prompt_tokens: int
    context_tokens: int
    memory: tuple[RankMemory, ...]
    streams: int = 1  # requests at once the loaded figure is priced for
    objective: Literal["latency", "throughput"] = "latency"  # what the planner chose it for
    reason: str = ""  # why that objective (the planner's words)
    # A vision checkpoint's tower on its rank's device, for one image at the checkpoint's
    # image size: every weight once per patch (2 FLOPs each) at the device's prefill speed,
    # added to an image prompt's time (0: a text model).
    tower_seconds: float = 0.0

    @computed_field  # type: ignore[prop-decorator]
    @property
    def loaded_tokens_per_second(self) -> float:
        """Every stream's tokens per second together, ``streams`` at once, stages overlapped."""
        lanes = min(len(self.stages), self.streams)
        rows = -(-self.streams // lanes)
        trip = sum(s.batch_seconds(rows) for s in self.stages) + self.hop_seconds
        slowest = max(s.batch_seconds(rows) for s in self.stages)
        return self.streams / max(trip, lanes * slowest)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def decode_seconds(self) -> float:
        """Predicted seconds per decoded token."""
        return sum(s.seconds for s in self.stages) + self.hop_seconds

    @computed_field  # type: ignore[prop-decorator]
    @property
    def tokens_per_second(self) -> float:
        return 1.0 / self.decode_seconds

    @computed_field  # type: ignore[prop-decorator]
    @property
    def prefill_seconds(self) -> float:
        return sum(s.prefill_seconds for s in self.stages) + self.prefill_hop_seconds

    @property
    def fits(self) -> bool:
        return all(m.fits for m in self.memory)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def context_fits(self) -> int | None:
        """Tokens of context per planned stream the plan's memory holds (the fullest rank)."""
        fits = [m.context_fits for m in self.memory if m.context_fits is not None]
        return min(fits) if fits else None

    def overflow(self) -> RankMemory | None:
        """The rank that overflows its device's memory the most, if any."""
        over = [m for m in self.memory if not m.fits]
        return max(over, key=lambda m: m.total - m.limit) if over else None


def _stage_cost(
    plan: PipelinePlan,
    index: int,
    stage: Stage,
    devices: Sequence[int],
    loads: Sequence[RankLoad],
    cluster: Cluster,
    prompt: int,
) -> StageCost:
    first, last = index == 0, index == len(plan.stages) - 1
    link = cluster.ring_link(devices)
    specs = [cluster.devices[d] for d in devices]
    overhead = max(d.layer_overhead for d in specs)
    decode = prefill = 0.0
    if link is not None:
        count = collective_count(stage.tp, stage.layers.size, first, last)
        fixed = count * collective_floor(stage.tp.size, link, overhead)
        decode = fixed + collective_seconds(stage.tp, stage.layers.size, first, last, link)
        prefill = fixed + collective_seconds(stage.tp, stage.layers.size, first, last, link, prompt)
    return StageCost(
        devices=tuple(devices),
        layers=(stage.layers.start, stage.layers.stop),
        compute_seconds=read_seconds(loads, specs)
        + overhead * (stage.layers.size + (TOKEN_OVERHEAD_LAYERS if last else 0.0)),
        collective_seconds=decode,
        per_sequence=table_for(plan.spec.model_type).batch_by_sequence,
        row_seconds=max(
            prefill_flops(x, 1) / d.prefill_flops for x, d in zip(loads, specs, strict=True)
        ),
        prefill_seconds=prefill
        + max(
            prefill_flops(x, prompt) / d.prefill_flops for x, d in zip(loads, specs, strict=True)
        ),
        link=link,
    )


def stage_width(spec: ModelSpec) -> int:
    """Floats per token a pipeline stage hands to the next: its hidden state, or with
    hyper-connections its hc_mult streams and their mix (DeepSeek V4.1, exo_tp.shard.streams;
    the compressed KV and selections it also hands on grow by a fraction of that per token)."""
    if not spec.hc_mult:
        return spec.hidden_size
    return spec.hc_mult * (spec.hidden_size + 1)


def _hops(plan: PipelinePlan, devices: Sequence[int], cluster: Cluster, tokens: int) -> float:
    if len(plan.stages) == 1:
        return 0.0
    hidden = stage_width(plan.spec) * FLOAT_BYTES * tokens
    first_ranks = [s.ranks[0] for s in plan.stages]
    # The last stage's first rank sends the tokens to every rank of stage 0 ...
    total = hop_seconds(
        TOKEN_BYTES * tokens,
        plan.stages[0].size,
        cluster.link(devices[first_ranks[-1]], devices[first_ranks[0]]),
    )
    # ... and each stage's sender (its first rank) its hidden state to every rank of the next.
    for a, b in zip(plan.stages, plan.stages[1:], strict=False):
        link = cluster.link(devices[a.ranks[a.sender]], devices[b.ranks[0]])
        total += hop_seconds(hidden, b.size, link)
    return total


def kv_width(load: RankLoad, kv: KvShape) -> int:
    """A rank's KV bytes per token of one stream at the planned width."""
    return kv_bytes_at_width(load.kv_bytes_per_token, FLOAT_BYTES, kv.bits, kv.group_size)


def predict(
    plan: PipelinePlan,
    devices: Sequence[int],
    cluster: Cluster,
    context_tokens: int = 4096,
    prompt_tokens: int = 512,
    streams: int = 1,
    kv: KvShape = FLOAT_KV,
    draft: DraftCost | None = None,
) -> Prediction:
    """Cost of ``plan`` with global rank r on ``cluster.devices[devices[r]]`` (``streams``:
    the load its loaded throughput is priced at; ``draft``: a draft model beside the
    conductor, counted in its memory where the plan speculates)."""
    if len(devices) != plan.size:
        raise ValueError(f"{len(devices)} devices for {plan.size} ranks")
    stages, memory = [], []
    for index, stage in enumerate(plan.stages):
        first, last = index == 0, index == len(plan.stages) - 1
        loads = [rank_load(plan.spec, shard, stage.layers, first, last) for shard in stage.tp.ranks]
        stage_devices = [devices[r] for r in stage.ranks]
        stages.append(_stage_cost(plan, index, stage, stage_devices, loads, cluster, prompt_tokens))
        memory += [
            RankMemory(
                rank=r,
                device=d,
                weights=x.held_bytes,
                kv_cache=kv.streams * (kv_width(x, kv) * context_tokens + x.state_bytes),
                limit=cluster.devices[d].memory,
                kv_per_token=kv_width(x, kv),
                state=x.state_bytes,
                streams=kv.streams,
                draft=draft.bytes_at(context_tokens) if draft and r == draft_rank(plan) else 0,
                tower=plan.spec.vision_bytes if r == tower_rank(plan) else 0,
                mtp=plan.spec.mtp_bytes if last else 0,
            )
            for r, d, x in zip(stage.ranks, stage_devices, loads, strict=True)
        ]
    return Prediction(
        stages=tuple(stages),
        hop_seconds=_hops(plan, devices, cluster, 1),
        prefill_hop_seconds=_hops(plan, devices, cluster, prompt_tokens),
        prompt_tokens=prompt_tokens,
        context_tokens=context_tokens,
        memory=tuple(memory),
        streams=streams,
        tower_seconds=_tower_seconds(plan, devices, cluster),
    )


def _tower_seconds(plan: PipelinePlan, devices: Sequence[int], cluster: Cluster) -> float:
    rank = tower_rank(plan)
    if rank is None:
        return 0.0
    spec = plan.spec
    flops = 2.0 * spec.vision_bytes / spec.dtype_bytes * spec.vision_patches
    return flops / cluster.devices[devices[rank]].prefill_flops
