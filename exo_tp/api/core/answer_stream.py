"""The generated text split as mlx_lm.server splits it: plain content, reasoning, and tool calls
(parsed by the model family's mlx-lm tool parser), chunk by chunk as it streams in."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from mlx_lm.generate import TextStateMachine, make_text_state_machine
from mlx_lm.server import ToolCallFormatter
from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo_tp.api.core.chat_prompt import Prompt

log = logging.getLogger(__name__)

# What mlx-lm's tool parsers raise on text that is no call of theirs: a regex that did not
# match (None.group: AttributeError), a missing field (KeyError, IndexError), a value of the
# wrong type (TypeError), bad JSON or Python literals (ValueError, SyntaxError). The model wrote
# it, so the call is dropped with a warning; anything else is a bug and logged as one.
MODEL_TEXT_ERRORS = (AttributeError, LookupError, TypeError, ValueError, SyntaxError)


@dataclass
class AnswerPiece:
    content: str = ""
    reasoning: str = ""
    # OpenAI-shaped calls: {"id", "type": "function", "function": {"name", "arguments"}}
    # (and "index" when streaming), as mlx_lm.server's ToolCallFormatter makes them
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def add(self, piece: AnswerPiece) -> None:
        """Append a later piece of the same answer."""
        self.content += piece.content
        self.reasoning += piece.reasoning
        self.tool_calls.extend(piece.tool_calls)


def _well_formed(call: Any) -> bool:
    """A call both APIs can return: a named function whose arguments are a JSON object."""
    try:
        function = call["function"]
        return isinstance(function["name"], str) and isinstance(
            json.loads(function["arguments"]), dict
        )
    except (TypeError, KeyError, ValueError):
        log.warning("dropped a malformed tool call: %.200r", call)
        return False


class AnswerStream:
    """Feed it the streamed text; it returns what each chunk completes.

    Tool calls are parsed only when the request offered tools; otherwise a tool-call-shaped
    text stays content, markers included. ``max_calls`` (1 with ``parallel_tool_calls``
    false) drops calls after the first ones."""

    def __init__(
        self,
        tokenizer: TokenizerWrapper,
        prompt: Prompt,
        streaming: bool,
        max_calls: int | None = None,
    ):
        self._machine = make_text_state_machine(tokenizer)
        self._state = self._machine.make_state(prompt.initial_state)
        self._previous = prompt.initial_state
        self._tool_text = ""
        self._markers = (tokenizer.tool_call_start or "", tokenizer.tool_call_end or "")
        self._parse = (
            ToolCallFormatter(tokenizer.tool_parser, prompt.tools, streaming)
            if prompt.tools is not None
            else None
        )
        self._calls_left = max_calls
        self.made_tool_call = False

    def feed(self, text: str) -> AnswerPiece:
        self._state, segments = TextStateMachine.split(self._state, text)
        return self._collect(segments)

    def finish(self, finish_reason: str) -> AnswerPiece:
        """The rest, at the end: what mlx_lm.server does with a held-back partial marker
        (kept at the length limit, dropped at a stop) and with an unclosed tool call."""
        if finish_reason == "length":
            self._state, rest, current = TextStateMachine.flush(self._state)
            piece = self._collect([(current, rest)])
        else:
            self._state, current = TextStateMachine.discard(self._state)
            piece = self._collect([(current, "")])
        if self._previous == "tool" and self._tool_text:
            self._close_tool(piece)
        return piece

    def _collect(self, segments: list[tuple[str | None, str]]) -> AnswerPiece:
        piece = AnswerPiece()
        for state, text in segments:
            if state == "reasoning":
                piece.reasoning += text
            elif state == "tool":
                self._tool_text += text
            elif state == "normal":
                if self._previous == "tool":
                    self._close_tool(piece)
                piece.content += text
            if state is not None:
                self._previous = state
        return piece

    def _close_tool(self, piece: AnswerPiece) -> None:
        text, self._tool_text = self._tool_text, ""
        if self._parse is None:
            start, end = self._markers
            piece.content += start + text + end
            return
        self.made_tool_call = True
        calls = [c for c in self._parsed(text) if _well_formed(c)]
        if self._calls_left is not None:
            calls, self._calls_left = (
                calls[: self._calls_left],
                max(0, self._calls_left - len(calls)),
            )
        piece.tool_calls.extend(calls)

    def _parsed(self, text: str) -> list[dict[str, Any]]:
        assert self._parse is not None
        try:
            return self._parse([text])
        except MODEL_TEXT_ERRORS as error:  # the model wrote a call the parser cannot read
            log.warning(
                "dropped a tool call the parser could not read (%s: %s)",
                type(error).__name__,
                error,
            )
        except Exception:  # a parser's own bug: the answer goes on, the traceback is logged
            log.exception("the tool parser failed on %.200r; the call is dropped", text)
        return []

    def finish_reason(self, reason: str) -> str:
        """OpenAI's finish reason: "tool_calls" when the answer stopped after calling tools."""
        return "tool_calls" if reason == "stop" and self.made_tool_call else reason


class PlainText:
    """A completion's text as it came, all of it content: its prompt is no conversation, so
    nothing in it is reasoning or a tool call (AnswerStream's interface)."""

    def feed(self, text: str) -> AnswerPiece:
        return AnswerPiece(content=text)

    def finish(self, finish_reason: str) -> AnswerPiece:
        return AnswerPiece()

    def finish_reason(self, reason: str) -> str:
        return reason
