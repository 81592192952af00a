"""The logits processor of a constrained request: the tokens its grammar does not allow next
get -inf on the full-vocabulary logits, on the conductor only (every rank then follows the
tokens it samples, so tensor and pipeline parallelism stay exact by construction)."""

from __future__ import annotations

import logging

import llguidance
import llguidance.numpy as llnp
import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)


class GrammarMask:
    """mlx-lm calls a row's processors with the row's tokens so far: first ending with the
    prompt's last token, then with each token sampled since. The matcher consumes each sampled
    token before the next step's mask, and allows end-of-sequence only where the grammar is
    complete (only it once nothing more can follow), so the text ends exactly where the
    grammar does."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos: list[int]):
        self._matcher, self._vocab_size = matcher, vocab_size
        self._eos = [t for t in eos if 0 <= t < vocab_size]
        self._bitmask = llnp.allocate_token_bitmask(1, vocab_size)
        self._started = False
        self._failed = False

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        matcher = self._matcher
        if self._started and not matcher.consume_token(int(tokens.reshape(-1)[-1].item())):
            if not self._failed:  # the sampler only picks allowed tokens: a bug, not the client
                log.error("grammar matcher failed: %s", matcher.get_error())
            self._failed = True
        self._started = True
        if self._failed:  # end the text (only end-of-sequence is left) rather than the batch
            allowed = np.zeros(self._vocab_size, dtype=bool)
            allowed[self._eos] = True
        else:
            llnp.fill_next_token_bitmask(matcher, self._bitmask, 0)
            bits = np.unpackbits(self._bitmask[0].view(np.uint8), bitorder="little")
            allowed = bits[: self._vocab_size].astype(bool)
        return mx.where(mx.array(allowed)[None], logits, -mx.inf)
