"""A step's decode rows and one prompt chunk in one forward pass (exo_tp.shard.fused_step),
inside mlx-lm's own step: when it can, and how."""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch

from exo_tp.runtime.diverged import DivergedError
from exo_tp.shard.fused_step import FusedForward

log = logging.getLogger("exo_tp.runtime.batching")
Response = GenerationBatch.Response


def fusable(generator: BatchGenerator) -> bool:
    """Whether this step's decode rows and prompt chunk can share one forward pass: rows
    decode (with room for more: mlx-lm skips the prompts of a full batch), and the one
    prompt prefilling neither moves to decoding nor is joined by another this step (a
    prompt batch of one: no padding to prepare before its chunk). Every rank holds the
    same batch and queue, so every rank decides alike."""
    rows, prompts = generator._generation_batch, generator._prompt_batch
    if not len(rows) or len(rows) >= generator.completion_batch_size:
        return False
    if len(prompts) != 1 or len(generator._currently_processing) != 1:
        return False
    segments = generator._currently_processing[0][0]
    if not segments or (len(segments) == 1 and len(segments[0]) == 1):
        return False
    joining = generator._unprocessed_sequences and generator.prefill_batch_size > 1
    return not joining


def step_fused(generator: BatchGenerator, fused: FusedForward, first: bool) -> list[Response]:
    """mlx-lm's step with its two model calls made one: the decode rows' call runs the chunk
    mlx-lm is about to take as well, and the prompt call that follows finds its chunk done.
    Everything else is mlx-lm's own step (``first``: the epoch's first such step, logged)."""
    rows, prompts = generator._generation_batch, generator._prompt_batch
    chunk = generator._currently_processing[0][0][0][: generator.prefill_step_size]

    def rows_and_chunk(inputs: mx.array, cache: list[Any]) -> mx.array:
        return fused(inputs, cache, mx.array([chunk]), prompts.prompt_cache)

    def chunk_done(tokens: mx.array, cache: list[Any]) -> None:
        if tokens.shape[1] != len(chunk):
            raise DivergedError(f"a chunk of {tokens.shape[1]}, fused {len(chunk)}")

    models, decoding = (rows.model, prompts.model), len(rows)
    rows.model, prompts.model = rows_and_chunk, chunk_done
    try:
        _, responses = generator.next()
    finally:
        rows.model, prompts.model = models
    if first:
        log.info(
            "a step ran its %d decode rows and a %d-token chunk in one pass", decoding, len(chunk)
        )
    return list(responses)
