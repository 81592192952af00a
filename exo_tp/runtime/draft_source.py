"""Where a rank's speculative drafts come from: the checkpoint's MTP heads (on every rank of
the last stage, exo_tp.runtime.mtp), a draft model (the conductor's, exo_tp.runtime.
draft_model), or prompt lookup on every rank (None here). The conductor chooses and tells
its followers in EndTokens (``model_drafts``); the last stage's ranks already agreed on the
MTP heads when they loaded them."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlx.core as mx

from exo_tp.errors import ExoTpError
from exo_tp.models.registry import resolve_model
from exo_tp.runtime.draft_model import ModelDrafter, fed_drafts, received_drafts
from exo_tp.runtime.follower import ControlFeed
from exo_tp.runtime.mtp.on_rank import MtpParts
from exo_tp.runtime.speculative import Drafter
from exo_tp.transport.channel import Channel
from exo_tp.wire.assignment import Assignment
from exo_tp.wire.runtime import EndTokens

log = logging.getLogger("exo_tp.rank")


def may_speculate(job: Assignment) -> bool:
    """Speculation only with a float KV cache (a quantized one is quantized as it grows and
    cannot be trimmed back)."""
    return job.serving.kv_bits is None


def conductor_drafter(
    job: Assignment,
    group: mx.distributed.Group,
    model_dir: Path,
    earlier: list[Channel[Any]],
    mtp: MtpParts | None,
    dtype: mx.Dtype | None,
) -> Drafter | None:
    """The MTP heads where the last stage holds them, else the draft model if the job names
    one and its plan speculates (``earlier``: the earlier pipeline stages' links, which the
    drafts reach by message). A draft model this node cannot find or use is logged and left
    out: requests then draft by prompt lookup."""
    if mtp is not None:
        return mtp.drafter(group, True, earlier)
    name = job.serving.draft_model
    if name is None or not job.serving.loads_draft():
        return None
    from exo_tp.models.draft import check_draft

    try:
        folder = Path(job.draft_dir) if job.draft_dir else resolve_model(name)
        model = check_draft(model_dir, folder, name, dtype)
        mx.eval(model.parameters())  # loaded now, not inside the first step's drafts
        return ModelDrafter(model, group, earlier)
    except ExoTpError as error:
        log.warning("epoch %d: no draft model, prompt lookup instead: %s", job.epoch, error)
        return None


def follower_drafter(
    opening: EndTokens,
    in_last_stage: bool,
    group: mx.distributed.Group,
    feed: ControlFeed,
    mtp: MtpParts | None,
) -> Drafter | None:
    """Where a follower's drafts come from when the conductor drafts with a model: the last
    stage's ranks run the MTP heads beside it (their collectives) or take its broadcast, the
    earlier stages its Drafts messages; else None, prompt lookup on every rank."""
    if not opening.model_drafts:
        return None
    if not in_last_stage:
        return fed_drafts(feed)
    return mtp.drafter(group, False, []) if mtp is not None else received_drafts(group)
