"""The MTP heads on the ranks of the last stage: loaded where the job asks for them and the
checkpoint carries them, the final norm tapped, and agreed by every rank of the stage (all
hold them or none does: they draft in step, exo_tp.runtime.mtp.drafter)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from exo_tp.arch import table_for
from exo_tp.arch.table import ArchTable
from exo_tp.runtime.mtp.checkpoint import heads_names, load_heads
from exo_tp.runtime.mtp.drafter import MtpDrafter
from exo_tp.runtime.mtp.tap import HiddenTap
from exo_tp.shard.collectives import sum_over_ranks
from exo_tp.shard.layers import HiddenFeed, VocabParallelEmbedding
from exo_tp.shard.tree import get_path, has_path, set_path
from exo_tp.transport.channel import Channel
from exo_tp.wire.assignment import Assignment

log = logging.getLogger("exo_tp.rank")


@dataclass
class MtpParts:
    """What a last-stage rank drafts with: the heads, the tapped final norm, and the stage's
    embedding and LM head they read and write tokens through."""

    heads: nn.Module
    tap: HiddenTap
    embed: VocabParallelEmbedding
    lm_head: Any

    def drafter(
        self, group: mx.distributed.Group, conductor: bool, earlier: list[Channel[Any]]
    ) -> MtpDrafter:
        return MtpDrafter(self.heads, self.tap, self.embed, self.lm_head, group, conductor, earlier)


def _wanted(job: Assignment) -> bool:
    """Whether this job asks the last stage for MTP drafts (the same answer on every rank):
    --mtp, or auto where no draft model is named."""
    serving = job.serving
    if serving.mtp == "off" or serving.kv_bits is not None:  # speculation needs a float KV
        return False
    if job.stage_index != len(job.plan.stages) - 1:
        return False
    return serving.mtp == "on" or serving.draft_model is None


def _stage_parts(model: Any, table: ArchTable) -> tuple[VocabParallelEmbedding, Any] | None:
    """The stage's vocab-parallel embedding and its LM head (None where this stage holds no
    embedding rows: an untied model's last pipeline stage)."""
    embed = get_path(model, table.embedding)
    if isinstance(embed, HiddenFeed):
        embed = embed.embedding
    if not isinstance(embed, VocabParallelEmbedding):
        return None
    head = get_path(model, table.lm_head) if has_path(model, table.lm_head) else None
    return embed, head if head is not None else embed.as_linear


def _problem(job: Assignment, model_dir: Path, has_parts: bool) -> str:
    """Why this rank cannot draft with MTP heads ("" where it can)."""
    if not has_parts:
        return "the last stage holds no embedding rows (an untied model's pipeline)"
    if job.serving.mtp == "auto" and mx.default_device().type != mx.gpu:
        return "auto: on a CPU a verify step costs several decode steps (--mtp to use them)"
    if not heads_names(model_dir):
        return "the checkpoint carries no MTP heads mlx-vlm can load"
    return ""


def mtp_on_rank(
    job: Assignment, model_dir: Path, model: Any, group: mx.distributed.Group, dtype: Any
) -> MtpParts | None:
    """The MTP parts on a rank of the last stage where every rank of it can hold them (the
    same decision everywhere: one all-reduce among the stage's ranks), else None."""
    if not _wanted(job):
        return None
    table = table_for(job.plan.spec.model_type)
    parts, heads = _stage_parts(model, table), None
    problem = _problem(job, model_dir, parts is not None)
    if not problem:
        try:
            heads = load_heads(model_dir, dtype)
        except Exception as error:  # (mlx-vlm's loaders raise what they raise) served without
            problem = f"its MTP heads did not load: {error}"
    everyone = sum_over_ranks(mx.array([int(not problem)]), 1, group).item() == group.size()
    if problem or not everyone or heads is None or parts is None:
        if job.serving.mtp == "on" and (problem or job.rank == job.conductor_rank):
            log.warning("epoch %d: no MTP drafts: %s", job.epoch, problem or "another rank")
        return None
    tap = HiddenTap(get_path(model, table.norm))
    set_path(model, table.norm, tap)
    mb = job.plan.spec.mtp_bytes / 1e6  # (as the planner counted them)
    log.info("epoch %d rank %d: MTP heads loaded (%.1f MB)", job.epoch, job.rank, mb)
    return MtpParts(heads, tap, parts[0], parts[1])
