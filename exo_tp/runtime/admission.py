"""Which waiting prompts prefill next, and in what chunks: the admission policy of a rank's
batch (exo_tp.runtime.batching). Every rank holds the same batch, queue and step count, so every
rank decides alike and the lockstep holds."""

from __future__ import annotations

from typing import Any

from mlx_lm.generate import BatchGenerator

from exo_tp.plan.step_budget import MIN_CHUNK, chunk_at
from exo_tp.wire.assignment import ServingOptions


class Admission:
    """Shortest prompt first (the overdue first of all), a prompt batch sized to start the next
    prefill as soon as a slot frees, and chunks sized by the step's token budget."""

    def __init__(self, options: ServingOptions):
        self.prefill_batch_size = min(options.prefill_batch_size, options.max_concurrency)
        # Chunked prefill with a token budget (exo_tp.plan.step_budget): while streams decode,
        # a step carries their tokens and at most the rest of the budget of prompt tokens.
        self._step_size, self._budget = options.prefill_step_size, options.step_token_budget
        self._ratio = options.chunk_attention_ratio  # a chunk priced at its position
        self.cached: dict[int, int] = {}  # prompt tokens each uid had from the prompt cache
        # A quantized KV cache: mlx-lm quantizes a sequence's cache after the chunk that takes
        # it past quantized_kv_start, its chunks being prefill_step_size long; until a prompt
        # has passed that chunk's end its chunks keep that size, so it attends exactly what
        # mlx-lm's does (after it, quantized keys are the same whatever the chunks).
        start = max(1, options.quantized_kv_start)
        self._kv_grid = (
            None
            if options.kv_bits is None
            else -(-start // options.prefill_step_size) * options.prefill_step_size
        )
        # Waiting prompts are prefilled shortest first, except that one which waited more than
        # `patience` steps goes first (oldest first), so a long prompt is never starved by a
        # stream of short ones. `joined`: the step each uid joined at.
        self.patience = 4 * options.max_concurrency
        self.joined: dict[int, int] = {}

    def prepare(self, generator: BatchGenerator, steps: int) -> None:
        """Before a step: order the queue, size the prompt batch and the chunk."""
        self._order_waiting(generator, steps)
        self._make_room(generator)
        self._size_chunks(generator)

    def _order_waiting(self, generator: BatchGenerator, steps: int) -> None:
        """Put the prompts not yet prefilling in admission order: shortest first (the first
        tokens of many short prompts come sooner than in arrival order), the overdue first of
        all."""
        waiting = generator._unprocessed_sequences
        if len(waiting) < 2:
            return

        def key(sequence: tuple[Any, ...]) -> tuple[int, int, int]:
            uid, segments = sequence[0], sequence[1]
            if steps - self.joined.get(uid, steps) > self.patience:
                return (0, uid, 0)
            return (1, sum(len(s) for s in segments), uid)

        ordered = sorted(waiting, key=key)
        waiting.clear()
        waiting.extend(ordered)

    def _make_room(self, generator: BatchGenerator) -> None:
        """Let the next waiting prompt start its prefill in the step where the prompts whose
        prefill is done (only their last token left) move to decoding. mlx-lm sizes the
        prompt batch before it moves them, so without this every prefill is followed by a
        step without one, and the moved prompts' first tokens wait one step more."""
        done = sum(
            1
            for segments, *_ in generator._currently_processing
            if len(segments) == 1 and len(segments[0]) == 1
        )
        generator.prefill_batch_size = self.prefill_batch_size + done

    def _size_chunks(self, generator: BatchGenerator) -> None:
        """This step's prompt chunk: prefill_step_size when no stream decodes (nothing to
        hold up), else the token budget less the decoding streams' tokens, shared by the
        prompts prefilling together."""
        chunk = self._step_size
        decoding = len(generator._generation_batch)
        if self._budget is not None and decoding and not self._before_quantized(generator):
            prefilling = len(generator._currently_processing)
            prefilling += len(generator._unprocessed_sequences)
            prefilling = max(1, min(generator.prefill_batch_size, prefilling))
            share = chunk_at(
                (self._budget - decoding) / prefilling, self._position(generator), self._ratio
            )
            chunk = max(MIN_CHUNK, min(self._step_size, share))
        generator.prefill_step_size = chunk
        generator._prompt_batch.prefill_step_size = chunk

    def _position(self, generator: BatchGenerator) -> int:
        """How far the furthest prompt prefilling now is (its cached tokens included)."""
        uids = generator._prompt_batch.uids if generator._prompt_batch is not None else []
        return max(
            (
                self.cached.get(uid, 0) + sequence[1]
                for uid, sequence in zip(uids, generator._currently_processing, strict=False)
            ),
            default=0,
        )

    def _before_quantized(self, generator: BatchGenerator) -> bool:
        """Whether a prompt that may prefill this step has not yet passed the chunk after
        which mlx-lm quantizes its cache (see __init__)."""
        if self._kv_grid is None:
            return False
        if generator._unprocessed_sequences:
            return True
        return any(done < self._kv_grid for _, done, _ in generator._currently_processing)
