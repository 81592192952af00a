"""OpenAI's response shapes: chat completions and plain completions, whole or as stream chunks,
with usage and per-token log-probabilities."""

from __future__ import annotations

import codecs
import platform
import time
from typing import Any

import mlx.core as mx
import mlx_lm

from exo_tp import __version__
from exo_tp.api.answer_stream import AnswerPiece
from exo_tp.api.token_text import TokenText
from exo_tp.runtime.messages import Done, TokenLogprob

# What OpenAI calls the backend configuration (mlx_lm.server: its versions and platform).
SYSTEM_FINGERPRINT = (
    f"exo-tp-{__version__}-mlx-{mx.__version__}-mlx_lm-"
    f"{mlx_lm.__version__}-{platform.system().lower()}-{platform.machine()}"
)


def usage(done: Done) -> dict[str, Any]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


def finish_reason(done: Done) -> str:
    return "stop" if done.finish_reason in ("stop", "cancelled") else "length"


class ChatLogprobs:
    """``choices[].logprobs`` of a chat completion: one entry per generated token, with the
    token's text and bytes and (as mlx_lm.server adds) its id."""

    def __init__(self, text: TokenText):
        self._text = text

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        piece, raw = self._text(token)
        return {"id": token, "token": piece, "logprob": logprob, "bytes": list(raw)}

    def content(self, scored: tuple[TokenLogprob, ...]) -> list[dict[str, Any]]:
        return [
            {
                **self._entry(s.token, s.logprob),
                "top_logprobs": [self._entry(t, lp) for t, lp in s.top],
            }
            for s in scored
        ]

    def block(self, scored: tuple[TokenLogprob, ...]) -> dict[str, Any]:
        return {"content": self.content(scored), "refusal": None}


class CompletionLogprobs:
    """``choices[].logprobs`` of a plain completion (OpenAI's legacy shape)."""

    def __init__(self, text: TokenText, top: int):
        self._text, self._top = text, top
        self.offset = 0  # characters of text before the next token
        # a character split over tokens counts once, where its last byte arrives (as in the text)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def block(self, scored: tuple[TokenLogprob, ...]) -> dict[str, Any]:
        tokens, offsets, tops = [], [], []
        for s in scored:
            piece, raw = self._text(s.token)
            tokens.append(piece)
            offsets.append(self.offset)
            self.offset += len(self._utf8.decode(raw))
            tops.append({self._text(t)[0]: lp for t, lp in s.top})
        return {
            "tokens": tokens,
            "token_logprobs": [s.logprob for s in scored],
            "top_logprobs": tops if self._top > 0 else None,
            "text_offset": offsets,
        }


class ChatShape:
    def __init__(self, request_id: str, model: str):
        self.id, self.model = request_id, model
        self.created = int(time.time())

    def _base(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }

    def chunk(
        self,
        piece: AnswerPiece | None,
        finish: str | None,
        logprobs: dict[str, Any] | None = None,
        first: bool = False,
    ) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if piece is not None:
            if piece.content:
                delta["content"] = piece.content
            if piece.reasoning:
                delta["reasoning"] = piece.reasoning
            if piece.tool_calls:
                delta["tool_calls"] = piece.tool_calls
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        return {**self._base("chat.completion.chunk"), "choices": [choice]}

    def usage_chunk(self, done: Done) -> dict[str, Any]:
        return {**self._base("chat.completion.chunk"), "choices": [], "usage": usage(done)}

    def whole(
        self, answer: AnswerPiece, finish: str, done: Done, logprobs: dict[str, Any] | None
    ) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "assistant",
            # null beside tool calls, as OpenAI and mlx_lm.server give it
            "content": answer.content if answer.content or not answer.tool_calls else None,
            "refusal": None,
        }
        if answer.reasoning:
            message["reasoning"] = answer.reasoning
        if answer.tool_calls:
            message["tool_calls"] = answer.tool_calls
        choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}
        return {**self._base("chat.completion"), "choices": [choice], "usage": usage(done)}


class CompletionShape:
    def __init__(self, request_id: str, model: str):
        self.id, self.model = request_id, model
        self.created = int(time.time())

    def _base(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }

    def chunk(
        self, text: str, finish: str | None, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}
        return {**self._base(), "choices": [choice]}

    def usage_chunk(self, done: Done) -> dict[str, Any]:
        return {**self._base(), "choices": [], "usage": usage(done)}

    def whole(
        self, text: str, finish: str, done: Done, logprobs: dict[str, Any] | None
    ) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}
        return {**self._base(), "choices": [choice], "usage": usage(done)}
