"""Streaming detokenizers per request: mlx-lm's own for answers (chat), and for continuations
(plain completions, Ollama's generate) the same ones without the first-token space trim.

mlx-lm's BPE and SentencePiece streaming detokenizers drop a leading space of the first text
they emit: right for a chat answer, wrong for a completion, whose text continues the prompt's
("The capital of France is" + " Paris"). OpenAI and llama-server keep that space.
"""

from __future__ import annotations

import copy
from typing import Any

from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    SPMStreamingDetokenizer,
    TokenizerWrapper,
)


class _KeepSpaceBPE(BPEStreamingDetokenizer):
    """mlx-lm's BPE detokenizer sharing a built one's token map, never trimming a space."""

    def __init__(self, tokenmap: list[str]):  # noqa: D107 - the base builds the map slowly
        self.tokenmap = tokenmap
        self.reset()

    def _maybe_trim_space(self, current_text: str) -> str:
        return current_text


class Detokenizers:
    """Fresh detokenizers for one tokenizer (the continuation prototype is built once)."""

    def __init__(self, tokenizer: TokenizerWrapper):
        self._tokenizer = tokenizer
        self._continuing: Any = None

    def new(self, continuation: bool) -> Any:
        if not continuation:
            return self._tokenizer.detokenizer
        if self._continuing is None:
            self._continuing = _keeping_space(self._tokenizer.detokenizer)
        fresh = copy.copy(self._continuing)
        fresh.reset()
        return fresh


def _keeping_space(base: Any) -> Any:
    if isinstance(base, BPEStreamingDetokenizer):
        return _KeepSpaceBPE(base.tokenmap)
    if isinstance(base, SPMStreamingDetokenizer):
        keeping = copy.copy(base)
        keeping.trim_space = False
        return keeping
    # mlx-lm's naive detokenizer decodes with the tokenizer itself: what it gives is the
    # tokenizer's own text, trimmed or not as its decode does
    return base
