"""OpenAI's response shapes: chat completions and plain completions, whole or as stream chunks,
with usage and per-token log-probabilities, as typed views (ApiView: a field left unset is left
out of the JSON, as OpenAI leaves out ``reasoning`` or ``usage``; a field set to None is null)."""

from __future__ import annotations

import codecs
import platform
import time
from typing import Any, Literal

import mlx.core as mx
import mlx_lm
from pydantic import ConfigDict

from exo_tp import __version__
from exo_tp.api.core.answer_stream import AnswerPiece
from exo_tp.api.core.token_text import TokenText
from exo_tp.api.http_io import ApiView
from exo_tp.wire.runtime import Done, TokenLogprob

# What OpenAI calls the backend configuration (mlx_lm.server: its versions and platform; mlx's
# stubs leave out its __version__).
SYSTEM_FINGERPRINT = (
    f"exo-tp-{__version__}-mlx-{mx.__version__}-mlx_lm-"  # type: ignore[attr-defined]
    f"{mlx_lm.__version__}-{platform.system().lower()}-{platform.machine()}"
)


# ---- the views -------------------------------------------------------------------------------


class PromptTokensDetails(ApiView):
    cached_tokens: int


class CompletionTokensDetails(ApiView):
    """OpenAI's names for predicted outputs, used for speculative decoding's drafts: drafted
    tokens the model agreed with, and those it did not (their positions were trimmed)."""

    accepted_prediction_tokens: int
    rejected_prediction_tokens: int


class Usage(ApiView):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = None  # set when drafted


class FunctionCall(ApiView):
    # What mlx_lm's tool parser returned beside name and arguments goes out as it came.
    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str  # a JSON object, as text


class ToolCall(ApiView):
    """As mlx_lm.server's ToolCallFormatter makes them (``index`` only when streaming)."""

    function: FunctionCall
    type: Literal["function"]
    id: str
    index: int | None = None


class TopLogprob(ApiView):
    id: int  # the token id, as mlx_lm.server adds it
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobsBlock(ApiView):
    content: list[ChatTokenLogprob]
    refusal: None


class CompletionLogprobsBlock(ApiView):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token (no context)
    # each token's alternatives: text -> logprob (None for the prompt's first token)
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


def joined(blocks: list[CompletionLogprobsBlock | None]) -> CompletionLogprobsBlock | None:
    """Blocks one after the other (an echoed prompt's, then the answer's)."""
    present = [b for b in blocks if b is not None]
    if not present:
        return None
    tops = [b.top_logprobs for b in present]
    return CompletionLogprobsBlock(
        tokens=[t for b in present for t in b.tokens],
        token_logprobs=[p for b in present for p in b.token_logprobs],
        top_logprobs=None if any(t is None for t in tops) else [x for t in tops for x in t or []],
        text_offset=[o for b in present for o in b.text_offset],
    )


class ChatDelta(ApiView):
    role: Literal["assistant"] | None = None  # the first chunk's only
    content: str = ""
    # the thinking, under the name most clients read (DeepSeek's, vLLM's) and mlx-lm's
    reasoning_content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = []


class ChatChunkChoice(ApiView):
    index: int
    delta: ChatDelta
    finish_reason: str | None
    logprobs: ChatLogprobsBlock | None


class ChatMessage(ApiView):
    role: Literal["assistant"]
    content: str | None  # null beside tool calls, as OpenAI and mlx_lm.server give it
    refusal: None
    reasoning_content: str = ""  # as ChatDelta's
    reasoning: str = ""
    tool_calls: list[ToolCall] = []


class ChatChoice(ApiView):
    index: int
    message: ChatMessage
    finish_reason: str
    logprobs: ChatLogprobsBlock | None


class _Answer(ApiView):
    """What every answer and chunk starts with (all required: a view sets each one)."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str


class ChatCompletion(_Answer):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage


class ChatCompletionChunk(_Answer):
    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # only the usage chunk (after the last) has it


class CompletionChoice(ApiView):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobsBlock | None


class Completion(_Answer):
    """A completion, or one chunk of a streamed one (the usage chunk has ``usage``)."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage | None = None


def _tool_calls(calls: list[dict[str, Any]]) -> list[ToolCall]:
    return [ToolCall.model_validate(call) for call in calls]


# ---- building them ---------------------------------------------------------------------------


def usage(done: Done) -> Usage:
    view = Usage(
        prompt_tokens=done.prompt_tokens,
        completion_tokens=done.completion_tokens,
        total_tokens=done.prompt_tokens + done.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=done.cached_tokens),
    )
    if done.drafted_tokens:  # left out otherwise, as before speculative decoding existed
        view.completion_tokens_details = CompletionTokensDetails(
            accepted_prediction_tokens=done.accepted_tokens,
            rejected_prediction_tokens=done.drafted_tokens - done.accepted_tokens,
        )
    return view


def finish_reason(done: Done) -> str:
    return "stop" if done.finish_reason in ("stop", "cancelled") else "length"


class ChatLogprobs:
    """``choices[].logprobs`` of a chat completion: one entry per generated token, with the
    token's text and bytes and (as mlx_lm.server adds) its id."""

    def __init__(self, text: TokenText):
        self._text = text

    def _entry(self, token: int, logprob: float) -> TopLogprob:
        piece, raw = self._text(token)
        return TopLogprob(id=token, token=piece, logprob=logprob, bytes=list(raw))

    def content(self, scored: tuple[TokenLogprob, ...]) -> list[ChatTokenLogprob]:
        out = []
        for s in scored:
            piece, raw = self._text(s.token)
            top = [self._entry(t, lp) for t, lp in s.top]
            out.append(
                ChatTokenLogprob(
                    id=s.token, token=piece, logprob=s.logprob, bytes=list(raw), top_logprobs=top
                )
            )
        return out

    def block(self, scored: tuple[TokenLogprob, ...]) -> ChatLogprobsBlock:
        return ChatLogprobsBlock(content=self.content(scored), refusal=None)


class CompletionLogprobs:
    """``choices[].logprobs`` of a plain completion (OpenAI's legacy shape)."""

    def __init__(self, text: TokenText, top: int):
        self._text, self._top = text, top
        self.offset = 0  # characters of text before the next token
        # a character split over tokens counts once, where its last byte arrives (as in the text)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def block(self, scored: tuple[TokenLogprob, ...]) -> CompletionLogprobsBlock:
        tokens: list[str] = []
        offsets: list[int] = []
        tops: list[dict[str, float]] = []
        for s in scored:
            tokens.append(self._advance(s.token, offsets))
            tops.append({self._text(t)[0]: lp for t, lp in s.top})
        return CompletionLogprobsBlock(
            tokens=tokens,
            token_logprobs=[s.logprob for s in scored],
            top_logprobs=tops if self._top > 0 else None,  # type: ignore[arg-type]
            text_offset=offsets,
        )

    def prompt_block(self, first: int, scored: tuple[TokenLogprob, ...]) -> CompletionLogprobsBlock:
        """An echoed prompt's: its first token unscored (null, as OpenAI and vLLM give it)."""
        offsets: list[int] = []
        head = self._advance(first, offsets)
        rest = self.block(scored)
        return CompletionLogprobsBlock(
            tokens=[head, *rest.tokens],
            token_logprobs=[None, *rest.token_logprobs],
            top_logprobs=None if rest.top_logprobs is None else [None, *rest.top_logprobs],
            text_offset=[*offsets, *rest.text_offset],
        )

    def _advance(self, token: int, offsets: list[int]) -> str:
        piece, raw = self._text(token)
        offsets.append(self.offset)
        self.offset += len(self._utf8.decode(raw))
        return piece


class ChatShape:
    def __init__(self, request_id: str, model: str, index: int = 0):
        self.id, self.model, self.index = request_id, model, index  # index: the choice's
        self.created = int(time.time())

    def _chunk(self, choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id,
            object="chat.completion.chunk",
            created=self.created,
            model=self.model,
            system_fingerprint=SYSTEM_FINGERPRINT,
            choices=choices,
        )

    def chunk(
        self,
        piece: AnswerPiece | None,
        finish: str | None,
        logprobs: ChatLogprobsBlock | None = None,
        first: bool = False,
    ) -> ChatCompletionChunk:
        delta = ChatDelta(role="assistant", content="") if first else ChatDelta()
        if piece is not None:
            if piece.content:
                delta.content = piece.content
            if piece.reasoning:
                delta.reasoning_content = delta.reasoning = piece.reasoning
            if piece.tool_calls:
                delta.tool_calls = _tool_calls(piece.tool_calls)
        choice = ChatChunkChoice(
            index=self.index, delta=delta, finish_reason=finish, logprobs=logprobs
        )
        return self._chunk([choice])

    def usage_chunk(self, done: Done) -> ChatCompletionChunk:
        view = self._chunk([])
        view.usage = usage(done)
        return view

    def whole(
        self, answer: AnswerPiece, finish: str, done: Done, logprobs: ChatLogprobsBlock | None
    ) -> ChatCompletion:
        message = ChatMessage(
            role="assistant",
            content=answer.content if answer.content or not answer.tool_calls else None,
            refusal=None,
        )
        if answer.reasoning:
            message.reasoning_content = message.reasoning = answer.reasoning
        if answer.tool_calls:
            message.tool_calls = _tool_calls(answer.tool_calls)
        return ChatCompletion(
            id=self.id,
            object="chat.completion",
            created=self.created,
            model=self.model,
            system_fingerprint=SYSTEM_FINGERPRINT,
            choices=[
                ChatChoice(
                    index=self.index, message=message, finish_reason=finish, logprobs=logprobs
                )
            ],
            usage=usage(done),
        )


class CompletionShape:
    def __init__(self, request_id: str, model: str, index: int = 0):
        self.id, self.model, self.index = request_id, model, index  # index: the choice's
        self.created = int(time.time())

    def _view(self, choices: list[CompletionChoice]) -> Completion:
        return Completion(
            id=self.id,
            object="text_completion",
            created=self.created,
            model=self.model,
            system_fingerprint=SYSTEM_FINGERPRINT,
            choices=choices,
        )

    def chunk(
        self, text: str, finish: str | None, logprobs: CompletionLogprobsBlock | None = None
    ) -> Completion:
        choice = CompletionChoice(
            index=self.index, text=text, finish_reason=finish, logprobs=logprobs
        )
        return self._view([choice])

    def usage_chunk(self, done: Done) -> Completion:
        view = self._view([])
        view.usage = usage(done)
        return view

    def whole(
        self, text: str, finish: str, done: Done, logprobs: CompletionLogprobsBlock | None
    ) -> Completion:
        choice = CompletionChoice(
            index=self.index, text=text, finish_reason=finish, logprobs=logprobs
        )
        view = self._view([choice])
        view.usage = usage(done)
        return view
