"""A request's sampler, logits processors and reported log-probabilities, built with mlx-lm's
own functions exactly as mlx_lm.server builds them."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import LogitsProcessor, Sampler, make_logits_processors, make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo_tp.runtime.messages import SamplingParams, TokenLogprob


def make_request_sampler(params: SamplingParams, tokenizer: TokenizerWrapper) -> Sampler:
    return make_sampler(
        params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
        xtc_probability=params.xtc_probability, xtc_threshold=params.xtc_threshold,
        xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids),
    )


def make_request_processors(params: SamplingParams) -> list[LogitsProcessor]:
    return make_logits_processors(
        params.logit_bias, params.repetition_penalty, params.repetition_context_size,
        params.presence_penalty, params.presence_context_size, params.frequency_penalty,
        params.frequency_context_size,
    )


def token_logprob(logprobs: mx.array, token: int, top: int) -> TokenLogprob:
    """``token``'s log-probability in ``logprobs`` (one step, the whole vocabulary) and the
    ``top`` most likely tokens, most likely first."""
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        ids = mx.argpartition(-logprobs, kth=top - 1)[:top]
        values = logprobs[ids]
        order = mx.argsort(-values)
        best = tuple(zip(ids[order].tolist(), values[order].tolist(), strict=True))
    return TokenLogprob(token=token, logprob=logprobs[token].item(), top=best)
