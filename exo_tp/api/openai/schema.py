"""OpenAI-compatible request bodies, strictly typed: every field the API accepts is honoured
(with mlx_lm.server's meaning), harmless bookkeeping fields are accepted, fields the cluster
cannot honour get a 400 naming them, and unknown fields get OpenAI's "Unrecognized request
argument" 400 (never a silent 200). Fields the cluster cannot honour: unsupported.py. A chat
request's conversation becomes the shared `Chat` (exo_tp.api.core.conversation)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from exo_tp.api.core.conversation import (
    Chat,
    FunctionSpec,
    ImagePart,
    Message,
    Part,
    TextPart,
    text_parts,
)
from exo_tp.api.core.images import image_from_url
from exo_tp.api.core.sampling import SamplingFields, check_stops
from exo_tp.api.core.strict import Passed, Strict
from exo_tp.wire.runtime import MAX_DRAFT_TOKENS

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOP_LOGPROBS = 20
MAX_PROMPTS = 64  # prompts in one completions request (lm-eval batches them)
MAX_CHOICES = 16  # n: each choice is a stream in the batch (--max-concurrency, 8 by default)
# apply_chat_template's own arguments: a request may set template variables, not these (a
# client's own "chat_template" would run arbitrary template code on the API's thread)
RENDER_ARGUMENTS = frozenset(
    {
        "chat_template",
        "conversation",
        "messages",
        "tools",
        "documents",
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
    }
)


# ---- conversations ---------------------------------------------------------------------


class ImageUrl(Passed):
    url: str
    detail: str | None = None  # OpenAI's resolution hint: accepted, the processor decides


class ContentPart(Passed):
    type: str
    text: str | None = None
    image_url: ImageUrl | None = None
    _image: ImagePart | None = PrivateAttr(default=None)  # decoded once, by the validator

    @field_validator("type")
    @classmethod
    def _known(cls, kind: str) -> str:
        if kind not in ("text", "refusal", "image_url"):
            raise ValueError(
                f"content parts of type {kind!r} are not supported: this cluster "
                "takes text and image_url parts"
            )
        return kind

    @model_validator(mode="after")
    def _read_image(self) -> ContentPart:
        if self.type == "image_url":  # a missing or unreadable image_url: the part's 400
            if self.image_url is None:
                raise ValueError("an image_url part needs its image_url: {'url': ...}")
            self._image = image_from_url(self.image_url.url, self.image_url.detail)
        return self

    def part(self) -> Part:
        if self._image is not None:
            return self._image
        return TextPart(text=self.text or getattr(self, "refusal", None) or "")


class FunctionCall(Passed):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any]

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str | dict[str, Any]) -> str | dict[str, Any]:
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                raise ValueError("must be a JSON object encoded as a string") from None
            if not isinstance(parsed, dict):
                raise ValueError("must encode a JSON object")
        return arguments


class ToolCall(Passed):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Passed):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
        return role

    def message(self) -> Message:
        """The message as the client sent it, its fields left out or null as sent (OpenAI's
        ``developer`` role is a system message to a chat template; a refusal part is text)."""
        content = self.content
        sent = self.model_dump(exclude_unset=True, include={"name", "tool_calls", "tool_call_id"})
        if "content" in self.model_fields_set:
            sent["parts"] = (
                [part.part() for part in content]
                if isinstance(content, list)
                else text_parts(content)
            )
        role = "system" if self.role == "developer" else self.role
        return Message.model_validate({"role": role, "passed": self.model_extra or {}, **sent})


class Tool(Passed):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # no obfuscation padding is ever added


class JsonSchemaFormat(Strict):
    """OpenAI's ``json_schema``: the text is decoded under ``schema`` (exo_tp.api.core.structured),
    strict or not (decoding is always constrained; ``strict`` only names OpenAI's promise)."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("'json_schema' is required with type 'json_schema', and only then")
        return self


# ---- what every generation request shares ------------------------------------------------


class _Generation(SamplingFields):
    model: str | None = None  # omitted: the served model (as mlx_lm.server does)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)  # choices: exo_tp.api.core.choices
    # bookkeeping that changes nothing in the answer
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # mlx-lm's name; here prompt-lookup speculative decoding's drafts per step (0: off,
    # None: the node's --num-draft-tokens), no draft model (exo_tp.runtime.speculative)
    num_draft_tokens: int | None = Field(default=None, ge=0, le=MAX_DRAFT_TOKENS)

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        check_stops([stop] if isinstance(stop, str) else stop or [])
        return stop

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    role_mapping: dict[str, str] | None = None  # mlx_lm.server: for models without a template
    prediction: dict[str, Any] | None = None  # a latency hint; the answer is the same

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        for key in kwargs or {}:
            if key in RENDER_ARGUMENTS:
                raise ValueError(
                    f"{key!r} is an argument of the template renderer, not a template variable"
                )
        return kwargs

    def chat(self) -> Chat:
        """The conversation with its tools, their choice and the template variables."""
        tools = [t.model_dump(exclude_unset=True) for t in self.tools] if self.tools else None
        choice = self.tool_choice
        return Chat(
            messages=[message.message() for message in self.messages],
            tools=tools,
            tool_choice=choice if isinstance(choice, str | None) else choice.model_dump(),
            template_args=self.chat_template_kwargs or {},
            role_mapping=self.role_mapping,
        )

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def wants_logprobs(self) -> bool:
        return self.logprobs or bool(self.top_logprobs)


class CompletionRequest(_Generation):
    # one prompt (text or token ids) or several, each its own choice (index in order)
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 with echo: the prompt only, scored when logprobs asks (what lm-eval sends)
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | bool | None = Field(default=None)  # OpenAI: top-n (0-5); mlx-lm: a bool
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # mlx-lm
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=1)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: Any) -> Any:
        if isinstance(prompt, list):
            if not prompt:
                raise ValueError("must not be empty")
            if isinstance(prompt[0], str | list) and len(prompt) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
            if any(isinstance(p, str | list) and not p for p in prompt):
                raise ValueError("must not hold an empty prompt")
        elif prompt == "":
            raise ValueError("must not be empty")
        return prompt

    @model_validator(mode="after")
    def _generates(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 generates nothing: only with echo (the prompt back)")
        if self.max_tokens == 0 and self.stream:
            raise ValueError("max_tokens 0 is answered whole: not with stream")
        return self

    @field_validator("logprobs")
    @classmethod
    def _top_n(cls, logprobs: int | bool | None) -> int | bool | None:
        if (
            isinstance(logprobs, int)
            and not isinstance(logprobs, bool)
            and not 0 <= logprobs <= MAX_TOP_LOGPROBS
        ):
            raise ValueError(f"must be between 0 and {MAX_TOP_LOGPROBS}")
        return logprobs

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("insertion (suffix) is not supported")
        return suffix

    def prompt_values(self) -> list[str | list[int]]:
        """Every prompt: its text, or its token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], str | list):
            return list(prompt)  # type: ignore[arg-type]
        return [list(prompt)]  # type: ignore[arg-type]

    def prompt_scores(self) -> int | None:
        """The prompt's own log-probabilities to compute, with this many alternatives (echo
        with logprobs; a prompt with no tokens generated is scored for its echo too)."""
        if self.echo and (self.wants_logprobs() or self.max_tokens == 0):
            return self.top_n()
        return None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None and self.logprobs is not False or bool(self.top_logprobs)

    def top_n(self) -> int:
        if isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool):
            return self.logprobs
        return self.top_logprobs or 0
