"""The logits processor of a constrained request: the tokens its grammar does not allow next
get -inf on the full-vocabulary logits, on the conductor only (every rank then follows the
tokens it samples, so tensor and pipeline parallelism stay exact by construction)."""

from __future__ import annotations

from typing import cast

import llguidance
import llguidance.numpy as llnp
import mlx.core as mx
import numpy as np

from exo_tp.grammar.compiler import short


def _last_token(tokens: mx.array) -> int:
    """The last of the sequence's token ids (an integer array: item() gives an int)."""
    return int(cast(int, tokens.reshape(-1)[-1].item()))


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
        self._consumed = 0
        self.failure: str | None = None  # why llguidance failed, once it has

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        matcher = self._matcher
        if self.failure is None and self._started:
            if matcher.consume_token(_last_token(tokens)):
                self._consumed += 1
            else:
                self._fail()
        self._started = True
        if self.failure is None:
            llnp.fill_next_token_bitmask(matcher, self._bitmask, 0)
            if matcher.is_error():
                self._fail()
        if self.failure is not None:  # end the text (only end-of-sequence is left), not the batch
            allowed = np.zeros(self._vocab_size, dtype=bool)
            allowed[self._eos] = True
        else:
            bits = np.unpackbits(self._bitmask[0].view(np.uint8), bitorder="little")
            allowed = bits[: self._vocab_size].astype(bool)
        return mx.where(mx.array(allowed)[None], logits, -mx.inf)

    def _fail(self) -> None:
        """Why, without the grammar (llguidance's short error: `LIMITS`); the conductor logs
        it once, with the request's id."""
        error = short(self._matcher.get_error())
        tokens = self._consumed
        self.failure = f"the schema's grammar failed while decoding after {tokens} tokens: {error}"
