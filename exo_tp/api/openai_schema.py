"""OpenAI-compatible request bodies, strictly typed: every field the API accepts is honoured
(with mlx_lm.server's meaning), harmless bookkeeping fields are accepted, fields the cluster
cannot honour get a 400 naming them, and unknown fields get OpenAI's "Unrecognized request
argument" 400 (never a silent 200)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from exo_tp.api.errors import ApiError
from exo_tp.wire.runtime import MAX_DRAFT_TOKENS

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOPS = 4
MAX_STOP_CHARS = 1000
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16  # n: each choice is a stream in the batch (--max-concurrency, 8 by default)
CONTEXT_SIZE_LIMIT = 2**31 - 1  # mlx slices token history with 32-bit indices
SEED_RANGE = (-(2**63), 2**64)  # int64 like OpenAI, or any uint64 like mx.random.seed
PENALTY_LIMIT = 100.0  # larger additive penalties only push logits to +-inf (NaN probabilities)
MIN_REPETITION_PENALTY = 0.01  # smaller divisors overflow float32 logits
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


class _Strict(BaseModel):
    # strict: "10" is not an integer and "true" is not a boolean, as in OpenAI's API
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class _Passed(BaseModel):
    """Parts of a conversation: known fields are checked, any others reach the chat template
    unchanged (templates read fields such as ``reasoning_content``)."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


# ---- conversations ---------------------------------------------------------------------


class ContentPart(_Passed):
    type: str
    text: str | None = None

    @field_validator("type")
    @classmethod
    def _text_only(cls, kind: str) -> str:
        if kind not in ("text", "refusal"):
            raise ValueError(
                f"content parts of type {kind!r} are not supported: this cluster "
                "serves a text-only model"
            )
        return kind

    def plain(self) -> str:
        return self.text or getattr(self, "refusal", None) or ""


class FunctionCall(_Passed):
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


class ToolCall(_Passed):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Passed):
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

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.plain() for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as the client sent it, for the chat template (OpenAI's ``developer``
        role is a system message to a chat template)."""
        message = self.model_dump(exclude_unset=True)
        if message["role"] == "developer":
            message["role"] = "system"
        if isinstance(self.content, list):  # text parts joined, as mlx_lm.server does
            message["content"] = self.text()
        return message


class FunctionSpec(_Passed):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Passed):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # no obfuscation padding is ever added


class JsonSchemaFormat(_Strict):
    """OpenAI's ``json_schema``: the text is decoded under ``schema`` (exo_tp.api.structured),
    strict or not (decoding is always constrained; ``strict`` only names OpenAI's promise)."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("'json_schema' is required with type 'json_schema', and only then")
        return self


# ---- what every generation request shares ------------------------------------------------


class SamplingFields(_Strict):
    """Sampling and penalties, with mlx_lm.server's meanings (None: the server default)."""

    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)  # 0 or 1: off (as in mlx-lm)
    top_k: int | None = Field(default=None, ge=0)  # 0: off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # 0: off
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])
    repetition_penalty: float | None = Field(default=None, ge=0.0, le=PENALTY_LIMIT)
    repetition_context_size: int = Field(default=20, ge=1, le=CONTEXT_SIZE_LIMIT)
    presence_penalty: float | None = Field(default=None, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    presence_context_size: int = Field(default=20, ge=1, le=CONTEXT_SIZE_LIMIT)
    frequency_penalty: float | None = Field(default=None, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    frequency_context_size: int = Field(default=20, ge=1, le=CONTEXT_SIZE_LIMIT)
    xtc_probability: float = Field(default=0.0, ge=0.0, le=1.0)
    xtc_threshold: float = Field(default=0.1, ge=0.0, le=0.5)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> added logit

    @field_validator("repetition_penalty")
    @classmethod
    def _divisor(cls, penalty: float | None) -> float | None:
        if penalty is not None and 0 < penalty < MIN_REPETITION_PENALTY:
            raise ValueError(f"must be 0 (off) or at least {MIN_REPETITION_PENALTY}")
        return penalty

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            try:
                int(key) if len(key) <= 20 else int("not a token id")
            except ValueError:
                raise ValueError(
                    f"keys must be token ids (whole numbers), not {key[:40]!r}"
                ) from None
            if not -100 <= value <= 100:
                raise ValueError(f"biases must be between -100 and 100, not {value}")
        return bias


class _Generation(SamplingFields):
    model: str | None = None  # omitted: the served model (as mlx_lm.server does)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)  # choices: exo_tp.api.choices
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
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences are at most {MAX_STOP_CHARS} characters")
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

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def wants_logprobs(self) -> bool:
        return self.logprobs or bool(self.top_logprobs)


class CompletionRequest(_Generation):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | bool | None = Field(default=None)  # OpenAI: top-n (0-5); mlx-lm: a bool
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # mlx-lm
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=1)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list):
            if not prompt:
                raise ValueError("must not be empty")
            if isinstance(prompt[0], str | list) and len(prompt) != 1:
                raise ValueError("exactly one prompt per request is supported")
            if isinstance(prompt[0], list) and not prompt[0]:
                raise ValueError("must not be empty")
        elif prompt == "":
            raise ValueError("must not be empty")
        return prompt

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

    def prompt_value(self) -> str | list[int]:
        """The one prompt: its text, or its token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        first = prompt[0]
        if isinstance(first, str | list):
            return first
        return list(prompt)  # type: ignore[arg-type]

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None and self.logprobs is not False or bool(self.top_logprobs)

    def top_n(self) -> int:
        if isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool):
            return self.logprobs
        return self.top_logprobs or 0


# ---- fields a client may send that the cluster cannot honour ------------------------------


# A request cannot choose its KV cache's width: a float batch runs all its sequences in one
# pass through mlx-lm's batch caches, which have no quantized form, so one quantized sequence
# would need its own pass, its own prompt-cache entries and admission by bytes, not built.
KV_FIELDS = ("kv_bits", "kv_group_size", "quantized_kv_start")
KV_WIDTH_PER_NODE = (
    "a KV cache's width is set for the whole cluster, not per request, with "
    "`exo-tp run --kv-bits 2..8` (and `--kv-group-size`, `--quantized-kv-start`) on its nodes"
)


def _absent(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {}


def _text_modalities(value: Any) -> bool:
    return value is None or value == ["text"]


_CANNOT: dict[str, tuple[Callable[[Any], bool], str]] = {
    # any audio object asks for spoken output, even {} (OpenAI then asks for its voice)
    "audio": (
        lambda value: value is None,
        "audio output is not supported: this cluster serves a text model",
    ),
    "modalities": (_text_modalities, "only the 'text' modality is supported"),
    "web_search_options": (_absent, "web search is not available on this cluster"),
    "functions": (
        _absent,
        "the deprecated 'functions' parameter is not supported; send 'tools' instead",
    ),
    "function_call": (
        _absent,
        "the deprecated 'function_call' parameter is not supported; send 'tool_choice' instead",
    ),
    "reasoning_effort": (
        _absent,
        "not supported; models with a thinking switch take "
        'chat_template_kwargs such as {"enable_thinking": false}',
    ),
    "adapters": (_absent, "LoRA adapters cannot be chosen per request on this cluster"),
    "adapter": (_absent, "LoRA adapters cannot be chosen per request on this cluster"),
    "draft_model": (
        _absent,
        "a draft model cannot be chosen per request on this cluster: the node's "
        "--draft-model drafts for every request (num_draft_tokens sets how many)",
    ),
    # mlx-lm's generate() names; its server has no such field (docs/api.md, Unsupported fields)
    **{name: (_absent, KV_WIDTH_PER_NODE) for name in KV_FIELDS},
}


def refuse_unsupported(body: dict[str, Any]) -> None:
    """A 400 naming the first field the cluster cannot honour."""
    for name, (harmless, why) in _CANNOT.items():
        if name in body and not harmless(body[name]):
            raise ApiError(
                400,
                f"Unsupported value for '{name}': {why}.",
                param=name,
                code="unsupported_parameter",
            )


def without_harmless(body: dict[str, Any]) -> dict[str, Any]:
    """The body without the unsupported fields (after `refuse_unsupported`: those sent empty,
    which mean nothing)."""
    return {k: v for k, v in body.items() if k not in _CANNOT}


def validation_error(error: ValidationError) -> ApiError:
    """The most specific problem of a pydantic error as a 400, naming the parameter like
    OpenAI (of a union's failed branches, the one that got furthest into the value)."""
    first = max(error.errors(), key=lambda e: len(e["loc"]))
    param = _param(first["loc"]) or None
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        message = f"Missing required parameter: '{param}'."
    elif first["type"] == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    elif param:
        message = f"Invalid value for '{param}': {message}"
    return ApiError(400, message, param=param)


def _param(loc: tuple[int | str, ...]) -> str:
    """pydantic's location as OpenAI names parameters (messages[0].content), leaving out the
    names of union branches that pydantic adds (str, list[...], function-after[...])."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in ("str", "int", "float", "bool", "list", "dict"):
            continue
        else:
            out += f".{part}" if out else part
    return out


def template_tool(name: str, description: str | None, parameters: dict[str, Any]) -> dict[str, Any]:
    """A tool as chat templates take it (OpenAI's function-tool form), from any dialect's."""
    function: dict[str, Any] = {"name": name, "parameters": parameters}
    if description:
        function["description"] = description
    return {"type": "function", "function": function}
