"""A request's `Constraint` compiled with llguidance for one tokenizer.

llguidance was chosen over xgrammar and outlines-core (measured on SmolLM2's 49152-token
vocabulary, docs/api.md#structured-outputs): it compiles a JSON schema in 1-10 ms where
outlines-core builds a whole-vocabulary DFA index in 30-280 ms, computes a step's mask in
~0.02-0.2 ms where outlines-core returns a Python list of allowed ids in ~0.6 ms, takes lark
grammars (tool calls) besides JSON schemas, and needs neither torch nor triton (xgrammar
does). The API and the conductor each compile: the API to answer a bad schema with a 400
before any work, the conductor to decode with it.

A schema that compiles can still be one llguidance cannot decode: a `$ref` loop whose language
is empty (`{"$ref": "#"}`) or infinite only (a required self-reference), or so many optional
properties that a step exceeds llguidance's limits. Compiling therefore refuses `$ref` cycles
that leave no finite value (`ref_cycles`), then walks the grammar's first tokens (`_probe`)
where it leaves few choices, under llguidance's own limits (`LIMITS`), and refuses the schema
where llguidance fails on that walk: what the model would otherwise meet after its first
token. Errors are llguidance's short ones (never the grammar nor the schema: a client must not
be able to grow the log)."""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import llguidance
import llguidance.hf
import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo_tp.grammar.ref_cycles import endless
from exo_tp.wire.runtime import Constraint

if TYPE_CHECKING:  # a TypedDict of llguidance's stubs only (not in the module at run time)
    from llguidance._lib import JsonCompileOptions

# What a JSON schema compiles to: separators as json.dumps writes them, and no other
# whitespace, so that a model cannot spend its token budget on blank space inside the value.
JSON_OPTIONS: JsonCompileOptions = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
}
CACHED_GRAMMARS = 256  # compiled grammars kept, by their text (clients repeat their schemas)
# llguidance's default limits on compile time, memory and a step's work; short errors (its
# verbose ones hold the parser's state and the grammar, the client's schema).
LIMITS = llguidance.LLParserLimits(verbose_errors=False)
PROBE_STEPS = 8  # tokens walked from the start of a grammar before it is accepted ...
PROBE_WIDTH = 8  # ... along at most this many paths, where a step allows at most this many


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
        self.vocab_size, self.eos = vocab_size, set(tokenizer.eos_token_ids)
        self._compiled: OrderedDict[Constraint, str | GrammarError] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint) -> str:
        """llguidance's grammar for ``constraint``, checked against the tokenizer; raises
        GrammarError naming what is wrong (refusals are kept too: a hostile schema costs its
        compile time once)."""
        with self._lock:
            known = self._compiled.get(constraint)
            if known is not None:
                self._compiled.move_to_end(constraint)
        if known is None:
            try:
                known = self._checked(constraint)
            except GrammarError as error:
                known = error
            with self._lock:
                self._compiled[constraint] = known
                while len(self._compiled) > CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
        if isinstance(known, GrammarError):
            raise GrammarError(str(known))
        return known

    def _checked(self, constraint: Constraint) -> str:
        grammar = self._grammar(constraint)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer, limits=LIMITS)
        if error:
            raise GrammarError(short(error))
        self._probe(grammar)
        return grammar

    def matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher at the start of ``constraint``'s text."""
        return self._matcher(self.compile(constraint))

    def _matcher(self, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise GrammarError(short(matcher.get_error()))
        return matcher

    def _probe(self, grammar: str) -> None:
        """Walk ``grammar`` from its start, token by token, along every path where a step
        allows at most `PROBE_WIDTH` tokens (forced ones included), for `PROBE_STEPS` steps;
        a GrammarError where llguidance fails on the way (a step allowing nothing, a step
        over its limits). A path ends where only end-of-sequence is allowed."""
        paths = [self._matcher(grammar)]
        for _ in range(PROBE_STEPS):
            following: list[llguidance.LLMatcher] = []
            for matcher in paths:
                tokens = self._allowed(matcher)
                if len(tokens) > PROBE_WIDTH:
                    continue  # the model's choice from here
                for token in tokens:
                    path = matcher.deep_copy()
                    if not path.consume_token(token):
                        raise GrammarError(f"it cannot be decoded: {short(path.get_error())}")
                    following.append(path)
            paths = following[:PROBE_WIDTH]

    def _allowed(self, matcher: llguidance.LLMatcher) -> list[int]:
        """The tokens ``matcher`` allows next, end-of-sequence left out."""
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
        if matcher.is_error():
            raise GrammarError(f"no JSON value satisfies it ({short(matcher.get_error())})")
        allowed = np.flatnonzero(bits[: self.vocab_size])
        if not allowed.size:
            raise GrammarError("no JSON value satisfies it")
        return [int(t) for t in allowed if int(t) not in self.eos]

    @staticmethod
    def _grammar(constraint: Constraint) -> str:
        try:
            if constraint.kind == "json_schema":
                if endless(json.loads(constraint.grammar)):
                    raise GrammarError("no finite JSON value satisfies it: a $ref cycle never ends")
                return llguidance.LLMatcher.grammar_from_json_schema(
                    constraint.grammar, defaults=JSON_OPTIONS
                )
            return llguidance.LLMatcher.grammar_from_lark(constraint.grammar)
        except (ValueError, TypeError, RuntimeError) as error:
            raise GrammarError(short(str(error))) from None


def short(error: str) -> str:
    """llguidance's error (a short one: `LIMITS`) in one line of at most 300 characters."""
    return " ".join(error.replace("<non-verbose/>", "").split())[:300]


@functools.lru_cache(maxsize=2)
def grammars_for(tokenizer: TokenizerWrapper, vocab_size: int) -> Grammars:
    """The one `Grammars` of this process for this tokenizer (the served model's)."""
    return Grammars(tokenizer, vocab_size)
