"""JSON views of the cluster's state that the API returns."""

from __future__ import annotations

from typing import Any

from exo_tp.plan.pipeline import PipelinePlan
from exo_tp.plan.predict import Prediction


def plan_view(plan: PipelinePlan, prediction: Prediction | None = None) -> dict[str, Any]:
    """The plan as /v1/plan shows it: stages (ranks, layers, each stage's TP plan) and, with
    one stage (the common case), that tensor-parallel plan as ``plan``; with the planner's
    prediction, ``predicted`` (null when shares were set by hand)."""
    stages = [
        {
            "ranks": list(s.ranks),
            "layers": s.layers.model_dump(),
            "plan": s.tp.model_dump(mode="json"),
        }
        for s in plan.stages
    ]
    predicted = (
        None
        if prediction is None
        else {
            "tokens_per_second": prediction.tokens_per_second,
            "decode_seconds_per_token": prediction.decode_seconds,
            "prefill_seconds": prediction.prefill_seconds,
            "prompt_tokens": prediction.prompt_tokens,
            "context_tokens": prediction.context_tokens,
        }
    )
    return {
        "stages": stages,
        "plan": stages[0]["plan"] if len(stages) == 1 else None,
        "predicted": predicted,
    }
