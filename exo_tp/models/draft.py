"""A draft model for speculative decoding (`--draft-model`): checked against the model it
drafts for before any rank starts, and loaded whole where it runs (the conductor)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache
from mlx_lm.utils import load_model

from exo_tp.errors import ExoTpError
from exo_tp.models.tokenizer import load_model_tokenizer


def check_draft(
    model_dir: Path, draft_dir: Path, name: str, dtype: mx.Dtype | None = mx.float32
) -> nn.Module:
    """The draft model, loaded lazily with its floats in ``dtype``, once checked: refuse one
    whose tokens are not the model's (one readable line): its drafts are token ids, which
    must mean the same text to both. Also one whose KV cache cannot be trimmed back after
    rejected drafts (sliding windows, recurrent states)."""
    ours = load_model_tokenizer(model_dir)._tokenizer.get_vocab()
    theirs = load_model_tokenizer(draft_dir)._tokenizer.get_vocab()
    if ours != theirs:
        differ = len(set(ours.items()) ^ set(theirs.items())) // 2 or 1
        raise ExoTpError(
            f"--draft-model {name}: its tokenizer is not the model's ({len(theirs)} tokens "
            f"against {len(ours)}, about {differ} ids mapped otherwise); a draft model must "
            "share the model's tokenizer"
        )
    model = load_draft(draft_dir, dtype, lazy=True)
    if not can_trim_prompt_cache(make_prompt_cache(model)):
        raise ExoTpError(
            f"--draft-model {name}: its KV cache cannot be trimmed after rejected drafts "
            "(sliding windows or a recurrent state); take a draft model with plain attention"
        )
    return model


def load_draft(draft_dir: Path, dtype: mx.Dtype | None, lazy: bool = False) -> nn.Module:
    """The draft model whole, its floating-point weights in ``dtype`` (None: as stored;
    quantized weights stay quantized)."""
    try:
        model, _ = load_model(Path(draft_dir), lazy=lazy)
    except (ValueError, KeyError, FileNotFoundError) as error:
        raise ExoTpError(f"--draft-model {draft_dir}: mlx-lm cannot load it: {error}") from None
    if dtype is not None:
        model.set_dtype(dtype)
    return model
