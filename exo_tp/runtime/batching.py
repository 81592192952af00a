"""Continuous batching on every rank of an epoch, in lockstep.

Every rank of every stage runs the same mlx-lm `BatchGenerator` over its own shard (its layers,
its heads, its KV caches) and must apply the same changes to the batch — a request joins
(`Insert`), requests leave (`Remove`) — before the same step. Given the same changes at the
same steps and the same sampled tokens, the generators evolve identically everywhere: the same
prompt chunks, the same cache merges and filters, the same finishes.

The conductor decides. It numbers each change and sends it at once over TCP to every other rank
(one message per change, not per token). Which changes apply before which step rides on the
token broadcast: with the B sampled tokens the conductor broadcasts one more number, the count of
changes it had committed when it sampled. Before a step, every rank applies the changes up to
the count carried by the *second-to-last* broadcast: the last one may still be computing
(mlx-lm evaluates the next tokens asynchronously), the one before is already known everywhere,
so reading it never waits. With nothing in flight there is no broadcast: an idle rank waits for
the next change and applies exactly that one (the conductor likewise), then steps again.

Ranks of earlier pipeline stages are not in the last stage's group: they receive the sampled
tokens and the same count in a `Tokens` message on the same TCP link as the changes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.models.cache import make_prompt_cache

from exo_tp.runtime.job import ServingOptions
from exo_tp.runtime.prompt_cache import PromptCache
from exo_tp.wire.runtime import Insert, Remove

log = logging.getLogger(__name__)

Word = mx.array | int  # the committed-changes count of one broadcast
# A rank's part of sampling: the step's log-probabilities (B, V) in, the agreed tokens (B,)
# and the broadcast count out.
RankSampler = Callable[[mx.array], tuple[mx.array, Word]]
Response = GenerationBatch.Response


class DivergedError(RuntimeError):
    """This rank's batch no longer matches the conductor's (a bug: the epoch must end)."""


class LockstepBatch:
    def __init__(
        self,
        model: nn.Module,
        eos_tokens: Sequence[int],
        options: ServingOptions,
        sample: RankSampler,
        bytes_per_token: int,
    ):
        self.model = model
        self._sample = sample
        self.generator = BatchGenerator(
            model,
            stop_tokens=[[t] for t in eos_tokens],
            sampler=self._sampler,
            completion_batch_size=options.max_concurrency,
            prefill_batch_size=min(8, options.max_concurrency),
            prefill_step_size=options.prefill_step_size,
        )
        self.prompt_cache = (
            PromptCache(options.prompt_cache_size, options.prompt_cache_bytes, bytes_per_token)
            if options.prompt_cache_size > 0
            else None
        )
        self._words: list[Word] = []
        self.applied = 0  # changes applied so far
        self.active: set[int] = set()  # uids in the batch
        self.steps = 0
        self.after_step: Callable[[], None] | None = None  # e.g. the live speed probe

    def _sampler(self, logprobs: mx.array) -> mx.array:
        tokens, word = self._sample(logprobs)
        self._words.append(word)
        return tokens

    @property
    def idle(self) -> bool:
        return not self.active

    def agreed(self) -> int:
        """How many changes are applied before the next step (the module doc says why)."""
        if self.idle:
            self._words.clear()
            return self.applied + 1
        if len(self._words) < 2:
            return self.applied
        word = self._words[-2]
        del self._words[:-2]
        return max(self.applied, int(word.item()) if isinstance(word, mx.array) else word)

    def insert(
        self,
        change: Insert,
        processors: list[Any] | None = None,
    ) -> tuple[int, mx.array | None]:
        """Apply an Insert: (prompt tokens covered by the prompt cache, the prompt's logits when
        the change asks for them)."""
        tokens = list(change.tokens)
        cache, cached = self.prompt_cache.fetch(tokens) if self.prompt_cache else (None, 0)
        logits = None
        if change.save_logits:  # every rank runs it: the forward has collectives
            logits = self.model(mx.array(tokens)[None], cache=make_prompt_cache(self.model))
            mx.eval(logits)
        (uid,) = self.generator.insert(
            [tokens[cached:]],
            max_tokens=[change.max_tokens],
            caches=[cache] if cache is not None else None,
            all_tokens=[tokens[:cached]] if cached else None,
            logits_processors=[processors] if processors is not None else None,
        )
        if uid != change.uid:
            raise DivergedError(f"request joined as {uid}, the conductor says {change.uid}")
        self.active.add(uid)
        self.applied += 1
        return cached, logits

    def remove(self, change: Remove) -> None:
        present = [uid for uid in change.uids if uid in self.active]
        if present:
            kept = self.generator.remove(present, return_prompt_caches=bool(self.prompt_cache))
            for cache, tokens in kept.values():
                self._remember(tokens, cache)
            self.active.difference_update(present)
        self.applied += 1

    def step(self) -> list[Response]:
        """One step of the generator: a decode step of the running sequences and a chunk of
        the joining prompts. Returns the generated tokens."""
        _, responses = self.generator.next()
        self.steps += 1
        if self.after_step is not None:
            self.after_step()
        for response in responses:
            if response.finish_reason is not None:
                self.active.discard(response.uid)
                self._remember(response.all_tokens, response.prompt_cache)
        return responses

    def _remember(self, tokens: list[int] | None, cache: list[Any] | None) -> None:
        if self.prompt_cache is not None and tokens and cache:
            self.prompt_cache.insert(list(tokens), cache)

    def close(self) -> None:
        self.generator.close()
