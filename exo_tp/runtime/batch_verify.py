"""Drafts inside a batch: every decoding stream drafts by prompt lookup and all are verified in
ONE batched forward (issue #61, point 4).

Each row of the verify step holds its stream's pending token and its own drafts, padded to
the longest row's count (a row without drafts is its one token and padding). The conductor
samples every position of every row (its row marker called per row and position, in order)
and broadcasts them as one step's tokens; every rank accepts per row the longest run of
drafts the model agrees with, plus the model's token after it, exactly as a lone stream's
speculative step does (exo_tp.runtime.speculative), with each stream's own back-off.

What a row did not keep leaves its KV cache as right padding: mlx-lm's BatchKVCache rolls a
row's rejected positions (and its padding) out past the batch's common end, where the next
steps overwrite them, and counts as many more positions of left padding for that row
(``prepare(right_padding=...)``, ``finalize()``: the same tool mlx-lm's own batched prefill
uses for prompts of unequal length). So rows keep unequal counts in one cache. Only models
whose caches are all whole-sequence KV caches do this; a recurrent state would need a
row-by-row restore and replay, and lone streams keep that (exo_tp.runtime.cache_rewind).

When: ServingOptions.batch_drafts; auto where every rank of one stage computes on a GPU,
where a verify step of a few positions per row costs about one decode step. On a CPU a step's
cost grows with its positions, so B rows of K + 1 positions cost about what B(K + 1) streams
would, and it does not pay (bench/speculative.py measures it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.models.cache import BatchKVCache

from exo_tp.runtime.cache_rewind import leaves, made_of
from exo_tp.runtime.speculative import finish_at, processed

Response = GenerationBatch.Response
Sampler = Callable[[mx.array], mx.array]


def can_verify_rows(generator: BatchGenerator) -> bool:
    """Several streams decoding, nothing prefilling or waiting, whole-sequence KV caches."""
    batch = generator._generation_batch
    return (
        len(batch) > 1
        and not generator._unprocessed_sequences
        and not generator._currently_processing
        and all(made_of(c, (BatchKVCache,)) for c in batch.prompt_cache)
    )


def _row(batch: GenerationBatch, row: int, logits: mx.array, inputs: mx.array) -> mx.array:
    """A row's logits through its request's processors (the conductor's: its row marker)."""
    processors = (batch.logits_processors or [])[row] or ()
    if not processors:
        return logits
    return processed(logits, inputs, batch._token_context[row].tokens, processors)


class RowsVerify:
    """The batched verify step (see the module doc)."""

    def __init__(self, model: nn.Module, sample: Sampler):
        self.model, self._sample = model, sample

    def run(
        self, generator: BatchGenerator, pending: list[int], drafts: list[list[int]]
    ) -> tuple[list[Response], list[int]]:
        """Verify each row's ``drafts`` after its ``pending`` token: every row's responses
        (cut at a finish as mlx-lm cuts a batch's) and each row's accepted count."""
        batch = generator._generation_batch
        width = 1 + max(len(d) for d in drafts)
        rows = [[y, *d, *[0] * (width - 1 - len(d))] for y, d in zip(pending, drafts, strict=True)]
        # (padding positions run too: their keys are rolled out with the rejected ones)
        with mx.stream(generator._stream):
            inputs = mx.array(rows, dtype=mx.uint32)
            logits = self.model(inputs, cache=batch.prompt_cache)
            if any(batch.logits_processors or []):  # the conductor's marks: row by position
                logits = mx.stack([_row(batch, i, logits[i], inputs[i]) for i in range(len(rows))])
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            targets_array = self._sample(logprobs.reshape(-1, logprobs.shape[-1]))
            mx.eval(targets_array, logprobs, batch._next_logprobs)
        targets = cast(list[int], targets_array.tolist())
        accepted, emitted, finishes = [], [], []
        for i, row in enumerate(drafts):
            picked = targets[i * width : (i + 1) * width]
            kept = 0
            while kept < len(row) and row[kept] == picked[kept]:
                kept += 1
            accepted.append(kept)
            run = [pending[i], *row[:kept]]
            finish = finish_at(batch, i, run)
            emitted.append(run if finish is None else run[: finish[0] + 1])
            finishes.append(finish)
        drops = [width - len(run) for run in emitted]
        for cache in leaves(batch.prompt_cache):
            cache.prepare(right_padding=drops)
            cache.finalize()
        nexts = [targets[i * width + a] for i, a in enumerate(accepted)]
        responses = self._responses(batch, emitted, logprobs, finishes)
        for i, run in enumerate(emitted):
            batch.tokens[i].extend(run)
            if (batch.logits_processors or [None] * len(emitted))[i]:
                batch._token_context[i].update_and_fetch(mx.array(run, dtype=mx.uint32))
        batch._next_tokens = mx.array(nexts, dtype=mx.uint32)
        batch._next_logprobs = [logprobs[i, a] for i, a in enumerate(accepted)]
        self._drop_finished(batch, finishes)
        return responses, accepted

    @staticmethod
    def _responses(
        batch: GenerationBatch,
        emitted: list[list[int]],
        logprobs: mx.array,
        finishes: list[tuple[int, str] | None],
    ) -> list[Response]:
        out = []
        for i, run in enumerate(emitted):
            uid = batch.uids[i]
            scores = [batch._next_logprobs[i], *(logprobs[i, j] for j in range(len(run) - 1))]
            batch._num_tokens[i] += len(run)
            for j, token in enumerate(run):
                finish = finishes[i]
                if finish is not None and j == len(run) - 1:
                    tokens = [*batch.tokens[i], *run]
                    cache = batch.extract_cache(i)
                    out.append(Response(uid, token, scores[j], finish[1], cache, tokens))
                else:
                    out.append(Response(uid, token, scores[j], None, None, None))
        return out

    @staticmethod
    def _drop_finished(batch: GenerationBatch, finishes: list[tuple[int, str] | None]) -> None:
        keep = [i for i, finish in enumerate(finishes) if finish is None]
        if len(keep) < len(finishes):
            batch.filter(keep)
