"""The prompt's own log-probabilities (``echo`` with ``logprobs``: what evaluation harnesses score
answers by), with the LM head split by vocabulary and never gathered.

Every rank of every stage runs the prompt through the model once more, in chunks, on a cache of
its own (the batch's prefill is untouched, and a request asking for no tokens never joins the
batch). On the last stage each rank's head gives logits for its vocabulary rows only; per
position it reduces them to its log-sum-exp, the next token's logit where it holds that row, and
its ``top`` best rows; one all-gather per chunk of those few numbers (positions x (2 + 2 top))
lets every rank combine them: log p(token) = its logit - log(sum over ranks of exp(their
log-sum-exp)). Equal to single-device mlx-lm's log-softmax within float32 rounding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from exo_tp.shard.layers import HeadMode, VocabParallelEmbedding, VocabParallelHead
from exo_tp.wire.runtime import Insert, TokenLogprob

CHUNK = 512  # positions per forward: bounds the local logits held at once


@contextlib.contextmanager
def head_mode(model: nn.Module, mode: HeadMode) -> Iterator[list[Any]]:
    """The model's vocab-parallel heads return this rank's logits only ("local"), or the
    hidden state they are given ("hidden": the model's final normed state); yields the heads
    (each knows its first row and its group)."""
    heads = [
        m for m in model.modules() if isinstance(m, VocabParallelHead | VocabParallelEmbedding)
    ]
    for head in heads:
        head.head_mode = mode
    try:
        yield heads
    finally:
        for head in heads:
            head.head_mode = "gathered"


def _chunk_stats(logits: mx.array, targets: mx.array, start: int, top: int) -> mx.array:
    """(positions, 2 + 2 top) of this rank's share: log-sum-exp, the target's logit (0 where
    another rank holds it; the sum over ranks is the logit), top values and global ids."""
    logits = logits.astype(mx.float32)
    rows = logits.shape[-1]
    positions = logits.shape[0]
    if rows == 0:
        empty = mx.full((positions, 1), -mx.inf)
        stats = [empty, mx.zeros((positions, 1))]
        if top:
            stats += [mx.full((positions, top), -mx.inf), mx.zeros((positions, top))]
        return mx.concatenate(stats, axis=1)
    lse = mx.logsumexp(logits, axis=-1, keepdims=True)
    local = targets - start
    inside = (local >= 0) & (local < rows)
    picked = mx.take_along_axis(logits, mx.where(inside, local, 0)[:, None], axis=-1)
    stats = [lse, mx.where(inside[:, None], picked, 0.0)]
    if top:
        k = min(top, rows)
        best = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k]
        values = mx.take_along_axis(logits, best, axis=-1)
        if k < top:  # fewer rows than asked: pad with entries that never win
            values = mx.concatenate([values, mx.full((positions, top - k), -mx.inf)], axis=1)
            best = mx.concatenate([best, mx.zeros((positions, top - k), mx.int32)], axis=1)
        stats += [values, (best + start).astype(mx.float32)]
    return mx.concatenate(stats, axis=1)


def _combine(gathered: mx.array, top: int) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Every rank's stats (ranks, positions, 2 + 2 top) into log-probabilities and top lists."""
    lse = mx.logsumexp(gathered[:, :, 0], axis=0)
    chosen = (mx.sum(gathered[:, :, 1], axis=0) - lse).tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in range(gathered.shape[1])]
    if top:
        values = gathered[:, :, 2 : 2 + top].transpose(1, 0, 2).reshape(gathered.shape[1], -1)
        ids = gathered[:, :, 2 + top :].transpose(1, 0, 2).reshape(gathered.shape[1], -1)
        order = mx.argsort(-values, axis=-1)[:, :top]
        best_values = (mx.take_along_axis(values, order, axis=-1) - lse[:, None]).tolist()
        best_ids = mx.take_along_axis(ids, order, axis=-1).astype(mx.int32).tolist()
        tops = [
            list(zip(row_ids, row_values, strict=True))  # type: ignore[arg-type]
            for row_ids, row_values in zip(best_ids, best_values, strict=True)  # type: ignore[arg-type]
        ]
    return chosen, tops  # type: ignore[return-value]


def score_prompt(model: nn.Module, tokens: list[int], top: int) -> tuple[TokenLogprob, ...]:
    """Each prompt token's log-probability after the tokens before it (the first has none),
    with the ``top`` most likely there; every rank runs it alike. Only the last stage's ranks
    hold the head and return scores; the others feed it and return none."""
    last = getattr(model, "holds_head", True)  # a pipeline stage's model says (StageModel)
    cache = make_prompt_cache(model)
    scored: list[TokenLogprob] = []
    with head_mode(model, "local") as heads:
        # the head's rows start where this rank's embedding rows do (one vocab split); a
        # model run whole (no table) has the whole vocabulary
        start = heads[0].vocab_start if heads else 0
        for begin in range(0, len(tokens) - 1, CHUNK):
            chunk = tokens[begin : begin + CHUNK]
            targets = tokens[begin + 1 : begin + 1 + len(chunk)]
            logits = model(mx.array(chunk)[None], cache=cache)
            if not last:
                mx.eval(logits)
                continue
            logits = logits[0, : len(targets)]
            stats = _chunk_stats(logits, mx.array(targets), start, top)
            group = heads[0].group if heads else None  # no table: one rank a stage
            ranks = 1 if group is None else group.size()
            gathered = stats if ranks == 1 else mx.distributed.all_gather(stats, group=group)
            chosen, tops = _combine(gathered.reshape(ranks, *stats.shape), top)
            scored += [
                TokenLogprob(token=t, logprob=p, top=tuple(best))
                for t, p, best in zip(targets, chosen, tops, strict=True)
            ]
    return tuple(scored)


def embed_prompt(model: nn.Module, tokens: list[int], pooling: str) -> tuple[float, ...]:
    """The prompt's embedding: the model's final normed hidden state (the heads give it back
    instead of logits; every rank of the last stage holds all of it), pooled over the prompt
    ("last" token, Qwen3-Embedding's, or "mean"); () on earlier stages' ranks."""
    last = getattr(model, "holds_head", True)
    with head_mode(model, "hidden") as heads:
        if not heads:
            raise ValueError("embeddings need a model split by its table (its LM head)")
        hidden = model(mx.array(tokens)[None], cache=make_prompt_cache(model))
        mx.eval(hidden)
    if not last:
        return ()
    pooled = hidden[0, -1] if pooling == "last" else mx.mean(hidden[0], axis=0)
    return tuple(pooled.astype(mx.float32).tolist())  # type: ignore[arg-type]


class Inserted(NamedTuple):
    """What applying an Insert gives the conductor."""

    cached: int  # prompt tokens covered by the prompt cache
    logits: mx.array | None  # the prompt's logits, where the change asked for them (launch)
    scores: tuple[TokenLogprob, ...]  # the prompt's log-probabilities, where asked
    embedding: tuple[float, ...] = ()  # the prompt's embedding, where asked


class PromptOutputs(NamedTuple):
    logits: mx.array | None
    scores: tuple[TokenLogprob, ...]
    embedding: tuple[float, ...]


def prompt_outputs(model: nn.Module, tokens: list[int], change: Insert) -> PromptOutputs:
    """What an Insert asks of its whole prompt besides generating: launch's saved logits (the
    full forward, gathered), the prompt's scores, its embedding. Every rank runs them alike."""
    logits = None
    if change.save_logits:
        logits = model(mx.array(tokens)[None], cache=make_prompt_cache(model))
        mx.eval(logits)
    scores: tuple[TokenLogprob, ...] = ()
    if change.prompt_logprobs is not None:
        scores = score_prompt(model, tokens, change.prompt_logprobs)
    embedding = embed_prompt(model, tokens, change.embed) if change.embed else ()
    return PromptOutputs(logits, scores, embedding)
