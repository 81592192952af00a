"""A request's sampling as mlx-lm does it: its sampler, its logits processors, and the
log-probabilities it reports (the same calls and arguments as mlx_lm.server)."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo_tp.wire.runtime import SamplingParams, TokenLogprob

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def request_sampler(params: SamplingParams, tokenizer: TokenizerWrapper) -> Sampler:
    """mlx-lm's sampler for these parameters (XTC spares newline and end tokens, as in
    mlx_lm.server)."""
    return make_sampler(
        params.temperature,
        top_p=params.top_p,
        min_p=params.min_p,
        top_k=params.top_k,
        xtc_probability=params.xtc_probability,
        xtc_threshold=params.xtc_threshold,
        xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids),
    )


def request_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """mlx-lm's logits processors: logit bias, then repetition, presence and frequency
    penalties over their own context sizes."""
    return make_logits_processors(
        params.logit_bias,
        params.repetition_penalty,
        params.repetition_context_size,
        params.presence_penalty,
        params.presence_context_size,
        params.frequency_penalty,
        params.frequency_context_size,
    )


def token_logprob(logprobs: mx.array, token: int, top: int) -> TokenLogprob:
    """The chosen token's log-probability and the ``top`` most likely tokens with theirs,
    most likely first, from one step's log-probabilities over the full vocabulary (what
    mlx-lm's generation loop returns: after the logits processors)."""
    row = logprobs.reshape(-1).astype(mx.float32)
    chosen = cast(float, row[token].item())  # a float32 row
    if top <= 0:
        return TokenLogprob(token=token, logprob=chosen)
    best = mx.argpartition(-row, kth=top - 1)[:top]
    values = row[best]
    order = mx.argsort(-values)
    ids, scores = cast(list[int], best[order].tolist()), cast(list[float], values[order].tolist())
    return TokenLogprob(token=token, logprob=chosen, top=tuple(zip(ids, scores, strict=True)))
