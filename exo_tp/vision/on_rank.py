"""A rank's part in serving images: its registry, the tower where it runs, the wrappers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.nn as nn

from exo_tp.plan.vision import tower_rank
from exo_tp.vision.families import vision_config
from exo_tp.vision.registry import VisionRegistry
from exo_tp.vision.text_model import teach_images
from exo_tp.wire.assignment import Assignment


def vision_on_rank(
    job: Assignment, model_dir: Path, model: nn.Module, dtype: Any
) -> VisionRegistry | None:
    """None for a text-only checkpoint; else the registry every batch change goes through,
    the tower loaded on the first stage's tower rank, the shard's wrappers installed."""
    config = vision_config(model_dir)
    if config is None:
        return None
    spec = job.plan.stages[job.stage_index].tp.spec
    registry = VisionRegistry(spec.vocab_size)
    first = job.stage_index == 0
    if job.rank == tower_rank(job.plan):
        from exo_tp.vision.tower import Tower

        registry.tower = Tower(model_dir, spec.hidden_size, dtype)
    teach_images(model, spec.model_type, config, registry, first)
    return registry
