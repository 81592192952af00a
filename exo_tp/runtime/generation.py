"""Token generation across ranks with mlx-lm's own loop (generate_step / stream_generate).

Every rank runs the same mlx-lm generation loop on its shard. Rank 0 samples; the token is
broadcast in the same collective as rank 0's stop flag, so every rank stops at the same token
even for reasons only rank 0 knows (a client went away, a stop string matched).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationResponse, stream_generate
from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo_tp.runtime.messages import SamplingParams
from exo_tp.runtime.sampling import request_processors, request_sampler
from exo_tp.shard.collectives import broadcast_from_first, zeros_after


@dataclass
class StopSignal:
    """Set on rank 0 (any thread) to end generation on every rank within a token or two."""

    _event: threading.Event = field(default_factory=threading.Event)

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()


class RankZeroSampler:
    """Samples on rank 0 only and broadcasts (token, stop flag) to every rank."""

    def __init__(self, sampler: Callable[[mx.array], mx.array], group: mx.distributed.Group,
                 stop: StopSignal):
        self._sampler = sampler
        self._group = group
        self._stop = stop
        self.flags: list[mx.array] = []

    def __call__(self, logprobs: mx.array) -> mx.array:
        if self._group.rank() == 0:
            token = self._sampler(logprobs).astype(mx.float32)
        else:  # sampled on rank 0 only; the broadcast below must still follow the logits
            token = zeros_after((logprobs.shape[0],), mx.float32, logprobs)
        flag = mx.array([1.0 if self._group.rank() == 0 and self._stop.is_set() else 0.0])
        agreed = broadcast_from_first(mx.concatenate([token, flag]), self._group)
        self.flags.append(agreed[-1])
        return agreed[:-1].astype(mx.uint32)

    def stopped(self, index: int) -> bool:
        return bool(self.flags[index].item())


def encode_prompt(tokenizer: TokenizerWrapper, prompt: str | None,
                  messages: list[dict[str, Any]] | None, use_chat_template: bool) -> list[int]:
    """Token ids the way `mlx_lm.generate` builds them (chat template unless told otherwise)."""
    if messages is None:
        messages = [{"role": "user", "content": prompt or ""}]
    if use_chat_template and tokenizer.has_chat_template:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    text = prompt if prompt is not None else "".join(str(m["content"]) for m in messages)
    return tokenizer.encode(text, add_special_tokens=True)


def generate(model: Any, tokenizer: TokenizerWrapper, prompt_tokens: list[int],
             params: SamplingParams, group: mx.distributed.Group,
             stop: StopSignal | None = None) -> Iterator[GenerationResponse]:
    """Stream responses; every rank must call this with the same arguments."""
    if params.seed is not None:
        mx.random.seed(params.seed)
    sampler = RankZeroSampler(request_sampler(params, tokenizer), group, stop or StopSignal())
    processors = request_processors(params)
    responses = stream_generate(model, tokenizer, mx.array(prompt_tokens),
                                max_tokens=params.max_tokens, sampler=sampler,
                                logits_processors=processors)
    # Response i carries token i, sampled (and flagged) by the i-th sampler call.
    for index, response in enumerate(responses):
        if sampler.stopped(index):
            break
        yield response
