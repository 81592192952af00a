"""Pipeline plans: tensor-parallel groups chained as stages, each holding a range of layers.

Plain uneven TP is the one-stage case. Stage s holds layers ``stages[s].layers`` with its own
TP plan over its ranks; the first stage also holds the embedding, the last the final norm and
LM head (with tied embeddings both hold vocab-parallel shards of the one table).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field, model_validator

from exo_tp.arch import pipeline_model_types, table_for
from exo_tp.errors import PlanError
from exo_tp.plan.cost import rank_load
from exo_tp.plan.shard_plan import ShardPlan, Span
from exo_tp.plan.spec import Frozen, ModelSpec
from exo_tp.plan.tensor_parallel import plan_tensor_parallel


class Stage(Frozen):
    ranks: tuple[int, ...] = Field(min_length=1)  # global ranks; local rank = position
    layers: Span
    tp: ShardPlan

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def sender(self) -> int:
        return hop_sender(self.tp)


def hop_sender(tp: ShardPlan) -> int:
    """The local rank of a stage (TP plan ``tp``) that hands its output to the next stage: the
    first, or where that output carries state attention makes (ArchTable.stage_state:
    DeepSeek V4.1's compressed KV and selections), the first holding heads (a rank without
    heads skips attention)."""
    if not table_for(tp.spec.model_type).stage_state:
        return 0
    return next((r.rank for r in tp.ranks if r.heads.q_heads.size), 0)


class PipelinePlan(Frozen):
    spec: ModelSpec
    stages: tuple[Stage, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> PipelinePlan:
        ranks = [r for s in self.stages for r in s.ranks]
        if sorted(ranks) != list(range(len(ranks))):
            raise ValueError(f"stage ranks {ranks} must be 0..N-1, each once")
        stops = [s.layers.start for s in self.stages[1:]]
        if (
            self.stages[0].layers.start != 0
            or self.stages[-1].layers.stop != self.spec.num_layers
            or stops != [s.layers.stop for s in self.stages[:-1]]
        ):
            raise ValueError("stages must hold consecutive layer ranges covering the model")
        for s in self.stages:
            if s.tp.size != s.size:
                raise ValueError("each stage's TP plan must have one rank per stage rank")
        return self

    @property
    def size(self) -> int:
        return sum(s.size for s in self.stages)

    def locate(self, rank: int) -> tuple[int, int]:
        """(stage index, local rank) of a global rank."""
        for index, stage in enumerate(self.stages):
            if rank in stage.ranks:
                return index, stage.ranks.index(rank)
        raise ValueError(f"rank {rank} is in no stage")


def single_stage(plan: ShardPlan) -> PipelinePlan:
    layers = Span(start=0, stop=plan.spec.num_layers)
    return PipelinePlan(
        spec=plan.spec, stages=(Stage(ranks=tuple(range(plan.size)), layers=layers, tp=plan),)
    )


def split_layers(
    num_layers: int, stage_speeds: Sequence[float], head_layers: float = 0.0
) -> tuple[int, ...]:
    """Layers per stage so every stage takes the same time: in proportion to its speed, the
    last stage's head counted as ``head_layers`` layers; every stage at least one."""
    if len(stage_speeds) > num_layers:
        raise PlanError(f"{len(stage_speeds)} stages for {num_layers} layers")
    if idle := [i + 1 for i, s in enumerate(stage_speeds) if s <= 0]:
        raise PlanError(
            f"stage {idle[0]} has no speed (its ranks' weights are all 0): every stage needs "
            "a rank with a weight above 0"
        )
    last = len(stage_speeds) - 1
    fixed = [head_layers / s if i == last else 0.0 for i, s in enumerate(stage_speeds)]
    counts = balance_layers(
        num_layers, [num_layers] * len(stage_speeds), fixed, [1 / s for s in stage_speeds]
    )
    assert counts is not None  # every stage may hold them all
    return tuple(counts)


def balance_layers(
    layers: int, caps: Sequence[int], fixed: Sequence[float], per_layer: Sequence[float]
) -> list[int] | None:
    """Layers so the slowest stage is as fast as it can be (it sets an overlapped pipeline's
    pace): one each, then every next layer to the stage that stays fastest with it, within
    its cap. Stage i with c layers takes fixed[i] + c * per_layer[i]."""
    counts = [1] * len(caps)
    for _ in range(layers - len(caps)):
        room = [i for i in range(len(caps)) if counts[i] < caps[i]]
        if not room:
            return None
        best = min(room, key=lambda i: (fixed[i] + (counts[i] + 1) * per_layer[i], i))
        counts[best] += 1
    return counts


# Of the tokens a serving stage processes, the share that are generated (the rest are prompt
# tokens): every token passes through every layer, but only generated ones (and a prompt's
# last) through the LM head. Prompts twice as long as their answers: a third. (bench/serving.py
# sends 40-100 token prompts for 32-token answers: 0.37. There SmolLM2 over 2 stages spent the
# most even CPU time per stage split 16/14: 15/15 left the head's stage, 17/13 the first, the
# busier; the tokens/s of the splits differed less than runs of one split do.)
GENERATED_SHARE = 1 / 3


def head_layers(spec: ModelSpec, generated_share: float = GENERATED_SHARE) -> float:
    """The LM head's work per processed token, in layers' worth: its weight reads per token
    (SmolLM2's tied 49152 x 576 head: 8 layers) times the share of tokens that reach it. It
    rides on the last stage, which would otherwise set an overlapped pipeline's pace."""
    whole = plan_tensor_parallel(spec, [1.0]).ranks[0]
    n = spec.num_layers
    body = rank_load(spec, whole, Span(start=0, stop=n), False, False).read_bytes
    head = rank_load(spec, whole, Span(start=0, stop=0), False, True).read_bytes
    return generated_share * head / body * n


def plan_unsplit(spec: ModelSpec, weights: Sequence[float]) -> tuple[PipelinePlan, list[int]]:
    """Devices of these share weights for a model no table splits (exo_tp.arch.generic): one
    device per stage, layers by weight, where its layers can be staged; else the heaviest
    device holds it whole. Devices of weight 0 hold nothing. Returns the plan and the devices
    it keeps, in stage order."""
    kept = [i for i, w in enumerate(weights) if w > 0] or [0]
    if not table_for(spec.model_type).stages or len(kept) == 1:
        kept = [max(range(len(weights)), key=lambda i: weights[i])]
    return plan_pipeline(spec, [[weights[i] or 1.0] for i in kept]), kept


def plan_pipeline(
    spec: ModelSpec,
    stage_weights: Sequence[Sequence[float]],
    layer_counts: Sequence[int] | None = None,
) -> PipelinePlan:
    """Stages of consecutive global ranks; ``stage_weights[s]`` are stage s's rank weights.

    Without ``layer_counts`` every stage takes the same time: its layers follow the sum of
    its weights (its speed), the last stage's LM head counted (`head_layers`).
    """
    if not stage_weights or any(not w for w in stage_weights):
        raise PlanError("every stage needs at least one rank")
    table = table_for(spec.model_type)
    if len(stage_weights) > 1 and not table.stages and not table.split:
        raise PlanError(f"pipeline stages refused: {table.why}")
    if len(stage_weights) > 1 and not table.stages:
        raise PlanError(
            f"pipeline stages are not supported for {spec.model_type} (only for "
            f"{', '.join(pipeline_model_types())}); run it as one stage"
        )
    if layer_counts is None:
        speeds = [sum(w) for w in stage_weights]
        layer_counts = split_layers(spec.num_layers, speeds, head_layers(spec))
    if len(layer_counts) != len(stage_weights):
        raise PlanError(f"{len(layer_counts)} layer counts for {len(stage_weights)} stages")
    if any(c < 1 for c in layer_counts) or sum(layer_counts) != spec.num_layers:
        raise PlanError(
            f"layer counts {list(layer_counts)} must be >= 1 and sum to {spec.num_layers}"
        )
    stages, rank, layer = [], 0, 0
    for weights, count in zip(stage_weights, layer_counts, strict=True):
        ranks = tuple(range(rank, rank + len(weights)))
        stages.append(
            Stage(
                ranks=ranks,
                layers=Span(start=layer, stop=layer + count),
                tp=plan_tensor_parallel(spec, weights),
            )
        )
        rank, layer = rank + len(weights), layer + count
    return PipelinePlan(spec=spec, stages=tuple(stages))
