"""A request's `Constraint` compiled with llguidance for one tokenizer.

llguidance was chosen over xgrammar and outlines-core (measured on SmolLM2's 49152-token
vocabulary, docs/api.md#structured-outputs): it compiles a JSON schema in 1-10 ms where
outlines-core builds a whole-vocabulary DFA index in 30-280 ms, computes a step's mask in
~0.02-0.2 ms where outlines-core returns a Python list of allowed ids in ~0.6 ms, takes lark
grammars (tool calls) besides JSON schemas, and needs neither torch nor triton (xgrammar
does). The API and the conductor each compile: the API to answer a bad schema with a 400
before any work, the conductor to decode with it."""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict

import llguidance
import llguidance.hf
from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo_tp.wire.runtime import Constraint

# What a JSON schema compiles to: separators as json.dumps writes them, and no other
# whitespace, so that a model cannot spend its token budget on blank space inside the value.
JSON_OPTIONS: llguidance.JsonCompileOptions = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
}
CACHED_GRAMMARS = 256  # compiled grammars kept, by their text (clients repeat their schemas)


class GrammarError(ValueError):
    """A constraint that llguidance cannot compile (or a tokenizer it cannot read)."""


class Grammars:
    """llguidance's view of one tokenizer (built once: ~1 s) and the grammars compiled for
    it, the most recent `CACHED_GRAMMARS` of them by their text."""

    def __init__(self, tokenizer: TokenizerWrapper, vocab_size: int):
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(
                tokenizer._tokenizer,
                n_vocab=vocab_size,
                eos_token=sorted(tokenizer.eos_token_ids),
            )
        except (ValueError, TypeError) as error:  # a slow (Python-only) or odd tokenizer
            raise GrammarError(
                f"this model's tokenizer cannot be used for constrained decoding: {error}"
            ) from None
        self._compiled: OrderedDict[Constraint, str] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint) -> str:
        """llguidance's grammar for ``constraint``, checked against the tokenizer; raises
        GrammarError naming what is wrong."""
        with self._lock:
            if constraint in self._compiled:
                self._compiled.move_to_end(constraint)
                return self._compiled[constraint]
        grammar = self._grammar(constraint)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise GrammarError(error.strip())
        with self._lock:
            self._compiled[constraint] = grammar
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return grammar

    def matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher at the start of ``constraint``'s text."""
        matcher = llguidance.LLMatcher(self.tokenizer, self.compile(constraint))
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher

    @staticmethod
    def _grammar(constraint: Constraint) -> str:
        try:
            if constraint.kind == "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(
                    constraint.grammar, defaults=JSON_OPTIONS
                )
            return llguidance.LLMatcher.grammar_from_lark(constraint.grammar)
        except (ValueError, TypeError, RuntimeError) as error:
            raise GrammarError(str(error).strip()) from None


@functools.lru_cache(maxsize=2)
def grammars_for(tokenizer: TokenizerWrapper, vocab_size: int) -> Grammars:
    """The one `Grammars` of this process for this tokenizer (the served model's)."""
    return Grammars(tokenizer, vocab_size)
