"""Where a vision checkpoint's tower runs (pure): whole on one rank of the first stage, the
first (the stage's ranks come fastest first from the planner), beside its shard, whose memory
the planner counts it in (RankMemory.tower, the search's room). Its merged embeddings enter the
first stage's all-reduce of the embedding there (exo_tp.vision.registry)."""

from __future__ import annotations

from exo_tp.plan.pipeline import PipelinePlan


def tower_rank(plan: PipelinePlan) -> int | None:
    """The global rank that runs the vision tower; None for a text model."""
    return plan.stages[0].ranks[0] if plan.spec.vision_bytes else None
