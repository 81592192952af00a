"""OpenAI Responses API request bodies (`POST /v1/responses`), strictly typed, and their
translation into the chat messages and tools (chat completions' shape) that chat templates
take. Nothing is stored: a conversation is sent whole, as input items."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
)

from exo_tp.api.openai_schema import (
    KV_FIELDS,
    KV_WIDTH_PER_NODE,
    SamplingFields,
    template_tool,
)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class _Item(BaseModel):
    # items a client sends back may carry ids, statuses and annotations: they change nothing
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class TextPart(_Item):
    type: Literal["input_text", "output_text", "text", "refusal"]
    text: str | None = None
    refusal: str | None = None

    def plain(self) -> str:
        return self.text or self.refusal or ""


_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        if isinstance(content, list):
            for i, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in _TEXT_PARTS:
                    raise ValueError(
                        f"content part {i} of type {kind!r} is not supported: this cluster "
                        "serves a text-only model (input_text and output_text parts)"
                    )
        return content

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.plain() for part in self.content)


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.plain() for part in self.output)


class ReasoningItem(_Item):
    """Reasoning of an earlier turn: not shown to the model again (chat templates drop it)."""

    type: Literal["reasoning"]


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_ITEMS: dict[str, type[BaseModel]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


class FunctionTool(_Item):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceTool(_Item):
    """A group of function tools under one name (Codex CLI's ``multi_agent_v1``): its
    functions are offered to the model as function tools of their own."""

    type: Literal["namespace"]
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    tools: list[FunctionTool] = []


class HostedTool(_Item):
    """A built-in tool (web search, file search, code interpreter, computer use, MCP, image
    generation...): this cluster cannot run it, so the model never sees it (left_out.py)."""

    type: str


def _tool_kind(tool: Any) -> str:
    kind = tool.get("type") if isinstance(tool, dict) else getattr(tool, "type", None)
    return kind if kind in ("function", "namespace") else "hosted"


AnyTool = Annotated[
    Annotated[FunctionTool, Tag("function")]
    | Annotated[NamespaceTool, Tag("namespace")]
    | Annotated[HostedTool, Tag("hosted")],
    Discriminator(_tool_kind),
]


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    """The answer's format: plain text, any JSON object, or JSON under ``schema`` (decoded
    under it, exo_tp.api.structured; ``strict`` or not, decoding is constrained)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint; the answer is the same


class Reasoning(_Strict):
    """``effort`` switches the chat template's ``enable_thinking``: off at "none", on at any
    other effort; left out, the server's --chat-template-args decide. ``summary`` is accepted:
    the reasoning item carries the whole reasoning text, no summary of it."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None  # no obfuscation padding is ever added


_NOT_STORED = (
    "responses are not stored on this cluster: send the whole conversation as 'input' items "
    "(with store=false)"
)


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    tools: list[AnyTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    truncation: Literal["disabled", "auto"] | None = None  # over the context is a 400 either way
    include: list[Literal["reasoning.encrypted_content"]] | None = None  # nothing to encrypt
    # what needs stored state or hosted services
    store: Literal[False] | None = None
    previous_response_id: None = None
    conversation: None = None
    background: Literal[False] | None = None
    prompt: None = None
    top_logprobs: Literal[0] | None = None
    # bookkeeping that changes nothing in the answer
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    client_metadata: dict[str, str] | None = None  # Codex CLI's ids of its session and turn

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, value: Any) -> Any:
        """Each item by its ``type`` (a message may leave it out), with a clear error for
        kinds this cluster lacks."""
        if not isinstance(value, list):
            if value == "":
                raise ValueError("must not be empty")
            return value
        if not value:
            raise ValueError("must not be empty")
        items = []
        for i, item in enumerate(value):
            kind = item.get("type", "message") if isinstance(item, dict) else None
            model = _ITEMS.get(kind) if isinstance(kind, str) else None
            if model is None:
                stored = " (items are not stored: send them whole)"
                raise ValueError(
                    f"input item {i} of type {kind!r} is not supported: this cluster takes "
                    "message, function_call and function_call_output items"
                    + (stored if kind == "item_reference" else "")
                )
            try:
                items.append(model.model_validate(item))
            except ValidationError as error:
                first = error.errors()[0]
                where = ".".join(str(p) for p in first["loc"])
                raise ValueError(f"input item {i}: {where}: {first['msg']}") from None
        return items

    def sampling(self) -> SamplingFields:
        return SamplingFields(temperature=self.temperature, top_p=self.top_p)

    def chat_messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        names: dict[str, str] = {}
        for item in self.input:
            if isinstance(item, MessageItem):
                role = "system" if item.role == "developer" else item.role
                out.append({"role": role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                names[item.call_id] = item.name
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                message = {"role": "tool", "tool_call_id": item.call_id, "content": item.text()}
                if item.call_id in names:
                    message["name"] = names[item.call_id]
                out.append(message)
        return out

    def template_args(self, defaults: dict[str, Any]) -> dict[str, Any]:
        """The server's chat template arguments, with thinking switched by the effort."""
        args = dict(defaults)
        if self.reasoning is not None and self.reasoning.effort is not None:
            args["enable_thinking"] = self.reasoning.effort != "none"
        return args

    def functions(self) -> list[FunctionTool]:
        """The function tools the model is offered: namespaces' functions included."""
        out: list[FunctionTool] = []
        for tool in self.tools or []:
            if isinstance(tool, FunctionTool):
                out.append(tool)
            elif isinstance(tool, NamespaceTool):
                out += tool.tools
        return out

    def left_out(self) -> list[str]:
        return [t.type for t in self.tools or [] if isinstance(t, HostedTool)]

    def chat_tools(self) -> list[dict[str, Any]] | None:
        functions = self.functions()
        if not functions:
            return None
        return [
            template_tool(
                t.name, t.description, t.parameters or {"type": "object", "properties": {}}
            )
            for t in functions
        ]

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if isinstance(choice, NamedFunction):
            return {"type": "function", "function": {"name": choice.name}}
        return choice

    def max_calls(self) -> int | None:
        if self.parallel_tool_calls is False:
            return 1
        return self.max_tool_calls


# fields whose only accepted values say "not used": a 400 that names what is missing
REFUSED = {
    "previous_response_id": _NOT_STORED,
    "conversation": _NOT_STORED,
    "store": _NOT_STORED,
    "background": "background responses are not supported (nothing is stored to poll)",
    "prompt": "stored prompt templates are not supported",
    "top_logprobs": "log-probabilities are not returned by the Responses API here; use "
    "/v1/chat/completions with logprobs",
    **dict.fromkeys(KV_FIELDS, KV_WIDTH_PER_NODE),
}
