"""Ollama API request bodies (https://github.com/ollama/ollama/blob/main/docs/api.md), strictly
typed, and their translation into the shared `Chat` (exo_tp.api.core.conversation) and sampling
fields. What this cluster cannot honour is refused with a 400 naming it, never ignored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from exo_tp.api.core.conversation import Chat, FunctionSpec, ImagePart, text_parts, tool_call
from exo_tp.api.core.conversation import Message as ChatMessage
from exo_tp.api.core.images import image_bytes
from exo_tp.api.core.sampling import PENALTY_LIMIT, SEED_RANGE, SamplingFields, check_stops
from exo_tp.api.core.strict import Passed, Strict
from exo_tp.durations import parse_duration

LATEST = ":latest"  # Ollama's default tag: "name" and "name:latest" are the same model


class Options(Strict):
    """The runner options Ollama takes, with the sampling ones mapped onto mlx-lm's sampler."""

    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])
    num_predict: int | None = Field(default=None, ge=-2)  # -1: the server's cap; -2: fill context
    stop: list[str] | None = None
    repeat_penalty: float | None = Field(default=None, ge=0.0, le=PENALTY_LIMIT)
    repeat_last_n: int | None = Field(default=None, ge=-1)  # 0 off, -1 the whole context
    presence_penalty: float | None = Field(default=None, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    frequency_penalty: float | None = Field(default=None, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    # how Ollama's runner uses the machine: they change no answer here
    num_ctx: int | None = Field(default=None, ge=1)
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    num_thread: int | None = None
    num_keep: int | None = None
    numa: bool | None = None
    low_vram: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    # samplers mlx-lm lacks: accepted only at their "off" values
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    tfs_z: float | None = None
    typical_p: float | None = None

    @field_validator("mirostat")
    @classmethod
    def _no_mirostat(cls, value: int | None) -> int | None:
        if value:
            raise ValueError("mirostat sampling is not supported by mlx-lm's sampler (use 0)")
        return value

    @field_validator("tfs_z", "typical_p")
    @classmethod
    def _off(cls, value: float | None) -> float | None:
        if value is not None and value != 1.0:
            raise ValueError("this sampler is not supported by mlx-lm's (use 1.0: off)")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, stops: list[str] | None) -> list[str] | None:
        check_stops(stops or [])
        return stops

    def sampling(self, context_length: int) -> SamplingFields:
        window = self.repeat_last_n
        penalty = self.repeat_penalty
        if window == 0 or penalty == 1.0:  # Ollama: 0 disables the penalty, 1.0 is no penalty
            penalty = None
        if window is None:
            size = 20  # mlx-lm's window
        else:
            size = context_length if window in (-1, 0) else min(window, context_length)
        return SamplingFields(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            repetition_penalty=penalty,
            repetition_context_size=size,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )

    def max_tokens(self, prompt_tokens: int, context_length: int) -> int | None:
        """num_predict as a token budget (None: the server's default)."""
        wanted = self.num_predict
        if wanted is None or wanted == -1:
            return None
        if wanted == -2 or wanted == 0:  # fill the context (0 would generate nothing useful)
            return max(1, context_length - prompt_tokens)
        return wanted


class ToolFunction(Passed):
    name: str = Field(min_length=1)
    arguments: dict[str, Any]


class ToolCall(Passed):
    function: ToolFunction


class Message(Passed):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    thinking: str | None = None
    images: list[str] | None = None  # base64 files, before the text (as Ollama renders them)
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    _images: list[ImagePart] = PrivateAttr(default_factory=list)  # decoded by the validator

    @model_validator(mode="after")
    def _read_images(self) -> Message:
        self._images = [
            ImagePart(data=image_bytes(image, f"image {i}"))
            for i, image in enumerate(self.images or [])
        ]
        return self

    def message(self) -> ChatMessage:
        """The message without its thinking (not shown again); a tool result names its tool."""
        fields: dict[str, Any] = {"name": self.tool_name} if self.tool_name else {}
        if self.tool_calls:
            fields["tool_calls"] = [
                tool_call(c.function.name, c.function.arguments) for c in self.tool_calls
            ]
        parts = [*self._images, *text_parts(self.content)]
        return ChatMessage(role=self.role, parts=parts, **fields)


class Tool(Passed):
    type: Literal["function"] = "function"
    function: FunctionSpec


class OllamaRequest(Strict):
    model: str | None = None
    stream: bool = True  # Ollama streams unless told not to
    options: Options | None = None
    format: str | dict[str, Any] | None = None
    # how long the model stays loaded once idle: seconds or Go's "5m" (0: unload it after
    # this request; negative: for ever), parsed by exo_tp.durations
    keep_alive: float | int | str | None = None
    think: bool | Literal["low", "medium", "high"] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @field_validator("format")
    @classmethod
    def _json_format(cls, value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if isinstance(value, str) and value not in ("", "json"):
            raise ValueError('must be "json" or a JSON schema (an object)')
        return value

    @field_validator("keep_alive")
    @classmethod
    def _duration(cls, value: float | int | str | None) -> float | int | str | None:
        if value is not None:
            parse_duration(value)  # its ValueError is the 400's message
        return value

    def keep_seconds(self) -> float | None:
        """``keep_alive`` in seconds (negative: for ever; None: not given)."""
        return None if self.keep_alive is None else parse_duration(self.keep_alive)

    @model_validator(mode="after")
    def _no_logprobs(self) -> OllamaRequest:
        if self.logprobs or self.top_logprobs:
            raise ValueError("logprobs are not supported on the Ollama API; use /v1/completions")
        return self

    def served_name(self) -> str | None:
        """The model's name without Ollama's default tag."""
        if self.model is None:
            return None
        return self.model.removesuffix(LATEST)

    def opts(self) -> Options:
        return self.options or Options()

    def _template_args(self) -> dict[str, Any]:
        """``think`` as the chat-template switch thinking models take."""
        if self.think is None:
            return {}
        return {"enable_thinking": bool(self.think)}


class ChatRequest(OllamaRequest):
    messages: list[Message] = Field(default_factory=list)
    tools: list[Tool] | None = None

    def chat(self) -> Chat:
        """The conversation and its tools, and the thinking switch."""
        tools = [
            {"type": "function", "function": t.function.model_dump(exclude_unset=True)}
            for t in self.tools or []
        ]
        return Chat(
            messages=[m.message() for m in self.messages],
            tools=tools or None,
            template_args=self._template_args(),
        )


class GenerateRequest(OllamaRequest):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None
    _images: list[ImagePart] = PrivateAttr(default_factory=list)  # decoded by the validator

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("insertion (suffix) is not supported")
        return suffix

    @field_validator("template")
    @classmethod
    def _no_template(cls, template: str | None) -> str | None:
        if template:
            raise ValueError(
                "custom (Go) prompt templates are not supported: the model's own chat "
                "template is used; send raw=true with a prompt you formatted yourself"
            )
        return template

    @field_validator("context")
    @classmethod
    def _no_context(cls, context: list[int] | None) -> list[int] | None:
        if context:
            raise ValueError(
                "the deprecated 'context' is not supported: send the conversation to /api/chat"
            )
        return context

    @model_validator(mode="after")
    def _read_images(self) -> GenerateRequest:
        if self.images and self.raw:
            raise ValueError("images need the model's template: they cannot go with raw=true")
        self._images = [
            ImagePart(data=image_bytes(image, f"image {i}"))
            for i, image in enumerate(self.images or [])
        ]
        return self

    def chat(self) -> Chat:
        """The prompt as a user message (its images first), after the system prompt, and the
        thinking switch."""
        system = [ChatMessage(role="system", parts=text_parts(self.system))] if self.system else []
        user = ChatMessage(role="user", parts=[*self._images, *text_parts(self.prompt)])
        return Chat(messages=[*system, user], template_args=self._template_args())


class ShowRequest(Strict):
    model: str | None = None
    name: str | None = None  # the older spelling of "model"
    verbose: bool | None = None

    def wanted(self) -> str | None:
        name = self.model or self.name
        return None if name is None else name.removesuffix(LATEST)
