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
from exo_tp.plan.apportion import largest_remainder
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


def split_layers(num_layers: int, stage_speeds: Sequence[float]) -> tuple[int, ...]:
    """Layers per stage in proportion to each stage's speed, every stage at least one."""
    if len(stage_speeds) > num_layers:
        raise PlanError(f"{len(stage_speeds)} stages for {num_layers} layers")
    counts = list(largest_remainder(num_layers, stage_speeds))
    for empty in [i for i, c in enumerate(counts) if c == 0]:
        counts[counts.index(max(counts))] -= 1  # lend from the biggest stage
        counts[empty] = 1
    return tuple(counts)


def plan_pipeline(
    spec: ModelSpec,
    stage_weights: Sequence[Sequence[float]],
    layer_counts: Sequence[int] | None = None,
) -> PipelinePlan:
    """Stages of consecutive global ranks; ``stage_weights[s]`` are stage s's rank weights.

    Without ``layer_counts`` a stage's layers follow the sum of its weights (its speed).
    """
    if not stage_weights or any(not w for w in stage_weights):
        raise PlanError("every stage needs at least one rank")
    if len(stage_weights) > 1 and not table_for(spec.model_type).stages:
        raise PlanError(
            f"pipeline stages are not supported for {spec.model_type} (only for "
            f"{', '.join(pipeline_model_types())}); run it as one stage"
        )
    if layer_counts is None:
        layer_counts = split_layers(spec.num_layers, [sum(w) for w in stage_weights])
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
