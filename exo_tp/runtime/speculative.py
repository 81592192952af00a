"""Prompt-lookup speculative decoding inside the lockstep batch (issue #44, first part).

A draft is no second model's guess: the tokens that followed the most recent earlier
occurrence of the sequence's last n-gram (in the prompt or the text generated so far). Editing,
quoting and summarising repeat long runs of the prompt, and there such drafts are often right.

One speculative step of a lone stream: the token sampled last (y, not yet in the KV cache) and
k drafts go through the tensor-parallel target in ONE forward (k + 1 positions: the same
forward, so the same collectives, on every rank); the conductor samples the target's greedy
choice at each position and broadcasts the k + 1 tokens as it broadcasts any step's; every
rank then accepts the longest run of drafts that agrees with them, plus the target's token
after that run, and trims its caches by the rejected positions. Every rank computes the same
drafts from the same agreed tokens and reads the same broadcast, so every rank takes the same
decision without one more message.

Greedy output is the target's own: a draft is kept only where it is the token the target
would have chosen. Sampled output keeps the target's distribution: each verified position is
sampled from the target's distribution p given the tokens before it (the request's own sampler,
row by row), and a draft d is kept where the sample equals it. A looked-up draft is a point (its
draft distribution q puts all its mass on d), and for a point this is rejection sampling
exactly: d is kept with probability p(d) = min(1, p(d) / q(d)), and a rejected position emits
the sample, which is then distributed as p without d, renormalised: max(0, p - q) normalised.
Positions after the first rejection are dropped, so every emitted token was drawn given the
tokens actually emitted before it. A seeded request draws its random numbers in another order
than without speculation (k + 1 rows a step), so its tokens differ, not its distribution.
When to speculate is decided in `exo_tp.runtime.batching` (one stream, a float KV cache,
caches a step can be taken back out of: exo_tp.runtime.cache_rewind) and by the conductor.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator, GenerationBatch

from exo_tp.runtime.cache_rewind import rewind, rewindable, save

Response = GenerationBatch.Response
# The rank's part of sampling, as the batch generator calls it: logprobs (rows, V) in, the
# agreed tokens (rows,) out (the broadcast from the conductor).
Sampler = Callable[[mx.array], mx.array]
# Drafts for a stream: (uid, its tokens so far, at most how many) -> the same drafts on every
# rank. Prompt lookup computes them on every rank; a draft model on the conductor broadcasts
# them (exo_tp.runtime.draft_model).
Drafter = Callable[[int, list[int], int], list[int]]


def prompt_lookup(history: Sequence[int], ngram: int, count: int) -> list[int]:
    """Up to ``count`` draft tokens: those that followed the most recent earlier occurrence
    of the longest suffix of ``history`` (``ngram`` tokens down to 1) seen before; none when
    no suffix repeats. Longer suffixes first: a longer match predicts its continuation better."""
    end = len(history)
    for size in range(min(ngram, end - 1), 0, -1):
        suffix = list(history[end - size :])
        # most recent first: nearby text is the likelier continuation
        for start in range(end - size - 1, -1, -1):
            if history[start : start + size] == suffix:
                follow = list(history[start + size : start + size + count])
                if follow:
                    return follow
    return []


class Backoff:
    """When drafting stops paying for a stream, it pauses. A verify step emits 1 + kept drafts
    and costs more than a plain step: on the 2-core CPU, 4 drafts verified cost ~2.1 plain
    steps (bench/speculative.py: 1.97x at 4.2 tokens a verify step). A stream whose last
    WINDOW verify steps emitted fewer than PAYS tokens on average (free text whose n-grams
    recur without their continuations, a draft model that disagrees) decodes plainly for a
    pause that doubles each time it fails again (FIRST_PAUSE up to LONGEST_PAUSE steps), then
    tries again. Every rank keeps the same counts (the same drafts, the same broadcast
    tokens), so every rank pauses alike."""

    WINDOW = 4
    PAYS = 2.0
    FIRST_PAUSE, LONGEST_PAUSE = 8, 256

    def __init__(self) -> None:
        self._recent: dict[int, deque[int]] = {}
        self._resume: dict[int, int] = {}
        self._pause: dict[int, int] = {}

    def allows(self, uid: int, step: int) -> bool:
        return step >= self._resume.get(uid, 0)

    def record(self, uid: int, step: int, accepted: int) -> None:
        """A verify step of ``uid`` at batch step ``step`` kept ``accepted`` drafts."""
        recent = self._recent.setdefault(uid, deque(maxlen=self.WINDOW))
        recent.append(1 + accepted)
        if len(recent) < self.WINDOW:
            return
        if sum(recent) >= self.PAYS * self.WINDOW:
            self._pause[uid] = self.FIRST_PAUSE
            return
        pause = self._pause.get(uid, self.FIRST_PAUSE)
        self._resume[uid] = step + pause
        self._pause[uid] = min(2 * pause, self.LONGEST_PAUSE)
        recent.clear()

    def forget(self, uid: int) -> None:
        for table in (self._recent, self._resume, self._pause):
            table.pop(uid, None)


def can_speculate(generator: BatchGenerator) -> bool:
    """One stream decoding, nothing prefilling or waiting, and caches a verify step can be
    taken back out of (exo_tp.runtime.cache_rewind: sliding windows cannot)."""
    batch = generator._generation_batch
    return (
        len(batch) == 1
        and not generator._unprocessed_sequences
        and not generator._currently_processing
        and all(rewindable(c) for c in batch.prompt_cache)
    )


class HiddenRows(Protocol):
    """The last stage's record of hidden states per position (an MTP drafter's,
    exo_tp.runtime.mtp.tap): a verify step's rejected positions are cut from it, and a
    stream joining starts it afresh."""

    def size(self) -> int: ...

    def cut(self, rows: int) -> None: ...

    def clear(self) -> None: ...


class SpeculativeStep:
    """A speculative step over a generator's lone decoding stream (see the module doc)."""

    def __init__(
        self, model: nn.Module, sample: Sampler, draft: Drafter, hidden: HiddenRows | None = None
    ):
        self.model, self._sample, self._draft, self._hidden = model, sample, draft, hidden

    def joined(self) -> None:
        """A stream joined the batch: hidden states recorded so far are another stream's."""
        if self._hidden is not None:
            self._hidden.clear()

    def drafts(self, generator: BatchGenerator, most: int) -> tuple[int, list[int]]:
        """The stream's pending token y (waited for: the drafts follow it) and its drafts."""
        batch = generator._generation_batch
        mx.eval(batch._next_tokens)
        token = int(batch._next_tokens[0].item())
        return token, self._draft(batch.uids[0], [*batch.tokens[0], token], most)

    def run(
        self, generator: BatchGenerator, token: int, drafts: list[int]
    ) -> tuple[list[Response], int]:
        """Verify ``drafts`` after ``token``: the stream's responses (y, then each accepted
        draft, cut at a finish as mlx-lm cuts a batch's) and how many drafts were accepted."""
        batch = generator._generation_batch
        recorded = self._hidden.size() if self._hidden is not None else 0
        with mx.stream(generator._stream):
            inputs = mx.array([token, *drafts], dtype=mx.uint32)
            saved = save(batch.prompt_cache)
            logits = self.model(inputs[None], cache=batch.prompt_cache)[0]
            processors = batch.logits_processors[0] or ()
            if processors:  # the conductor's row marker: called once per position, in order
                logits = processed(logits, inputs, batch._token_context[0].tokens, processors)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            targets_array = self._sample(logprobs)
            mx.eval(targets_array, logprobs, batch._next_logprobs)
        targets = cast(list[int], targets_array.tolist())  # one token id per position
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
            accepted += 1
        emitted = [token, *drafts[:accepted]]
        scores = [batch._next_logprobs[0], *(logprobs[i] for i in range(accepted))]
        finish = finish_at(batch, 0, emitted)
        kept = len(emitted) if finish is None else finish[0] + 1
        with mx.stream(generator._stream):
            rewind(self.model, batch.prompt_cache, saved, inputs, kept)
        if self._hidden is not None:
            self._hidden.cut(recorded + kept)
        batch.tokens[0].extend(emitted[:kept])
        if processors:
            batch._token_context[0].update_and_fetch(mx.array(emitted, dtype=mx.uint32))
        batch._next_tokens = mx.array([targets[accepted]], dtype=mx.uint32)
        batch._next_logprobs = [logprobs[accepted]]
        return self._responses(batch, emitted[:kept], scores, finish), accepted

    @staticmethod
    def _responses(
        batch: GenerationBatch,
        emitted: list[int],
        scores: list[mx.array],
        finish: tuple[int, str] | None,
    ) -> list[Response]:
        uid = batch.uids[0]
        batch._num_tokens[0] += len(emitted)
        responses = [
            Response(uid, token, score, None, None, None)
            for token, score in zip(emitted, scores, strict=False)
        ]
        if finish is not None:
            token, score = emitted[-1], scores[len(emitted) - 1]
            cache, tokens = batch.extract_cache(0), batch.tokens[0]
            responses[-1] = Response(uid, token, score, finish[1], cache, tokens)
            batch.filter([])
        return responses


def finish_at(batch: GenerationBatch, row: int, emitted: list[int]) -> tuple[int, str] | None:
    """mlx-lm's finish rules per emitted token of a row (max_tokens, EOS, the stop matcher):
    the index of the token that finishes the stream and why, or None. The rest of the run is
    then dropped, so the cache handed on holds exactly its tokens."""
    for i, token in enumerate(emitted):
        reason = "length" if batch._num_tokens[row] + i + 1 >= batch.max_tokens[row] else None
        if batch._matchers[row].advance(token):
            reason = "stop"
        if reason is not None:
            return i, reason
    return None


def processed(
    logits: mx.array, inputs: mx.array, seen: mx.array, processors: Sequence[Any]
) -> mx.array:
    """The verify step's logits through the request's processors, a position at a time with
    the tokens before it."""
    rows = []
    for i in range(len(inputs)):
        context = mx.concatenate([seen, inputs[: i + 1].astype(seen.dtype)])
        row = logits[i : i + 1]
        for processor in processors:
            row = processor(context, row)
        rows.append(row)
    return mx.concatenate(rows)


def lookup_drafter(ngram: int) -> Drafter:
    """Drafts by prompt lookup: the drafter where no draft model is given."""
    return lambda _uid, tokens, most: prompt_lookup(tokens, ngram, most)
