"""OpenAI Responses API request bodies (`POST /v1/responses`), strictly typed, and their
translation into the shared `Chat` (exo_tp.api.core.conversation): messages of content parts,
and tools in the shape chat templates take. Nothing is stored: a conversation is sent whole, as
input items."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from exo_tp.api.core.conversation import (
    Chat,
    ImagePart,
    Message,
    Part,
    TextPart,
    ToolCall,
    template_tool,
    text_parts,
    tool_call,
)
from exo_tp.api.core.images import image_from_url
from exo_tp.api.core.sampling import KV_FIELDS, KV_WIDTH_PER_NODE, SamplingFields
from exo_tp.api.core.strict import Passed, Strict


class _Item(Passed):
    """Items a client sends back may carry ids, statuses and annotations: they change nothing."""


class ContentPart(_Item):
    type: Literal["input_text", "output_text", "text", "refusal", "input_image"]
    text: str | None = None
    refusal: str | None = None
    image_url: str | None = None  # input_image: a data URL (or http(s), fetched if allowed)
    detail: str | None = None
    _image: ImagePart | None = PrivateAttr(default=None)  # decoded once, by the validator

    @model_validator(mode="after")
    def _read_image(self) -> ContentPart:
        if self.type == "input_image":  # a missing or unreadable image: the part's 400
            if not self.image_url:
                raise ValueError("an input_image part needs its image_url (file_id is not kept)")
            self._image = image_from_url(self.image_url, self.detail)
        return self

    def part(self) -> Part:
        if self._image is not None:
            return self._image
        return TextPart(text=self.text or self.refusal or "")


def _parts(content: str | list[ContentPart]) -> list[Part]:
    """A message's or an output's content as parts (a refusal is its text)."""
    if isinstance(content, str):
        return text_parts(content)
    return [part.part() for part in content]


_TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "input_image")


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        if isinstance(content, list):
            for i, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in _TEXT_PARTS:
                    raise ValueError(
                        f"content part {i} of type {kind!r} is not supported: this cluster "
                        "takes input_text, output_text and input_image parts"
                    )
        return content

    def message(self) -> Message:
        role = "system" if self.role == "developer" else self.role
        return Message(role=role, parts=_parts(self.content))


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[ContentPart]


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


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    """The answer's format: plain text, any JSON object, or JSON under ``schema`` (decoded
    under it, exo_tp.api.core.structured; ``strict`` or not, decoding is constrained)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint; the answer is the same


class Reasoning(Strict):
    """``effort`` switches the chat template's ``enable_thinking``: off at "none", on at any
    other effort; left out, the server's --chat-template-args decide. ``summary`` is accepted:
    the reasoning item carries the whole reasoning text, no summary of it."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class StreamOptions(Strict):
    include_obfuscation: bool | None = None  # no obfuscation padding is ever added


_NOT_STORED = (
    "responses are not stored on this cluster: send the whole conversation as 'input' items "
    "(with store=false)"
)


class ResponsesRequest(Strict):
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

    def chat(self) -> Chat:
        """The conversation, its function tools and their choice, and the thinking switch."""
        return Chat(
            messages=self._messages(),
            tools=self._tools(),
            tool_choice=self._tool_choice(),
            template_args=self._template_args(),
        )

    def _messages(self) -> list[Message]:
        """The instructions as a system message, then the input items: function calls join
        the assistant message before them, outputs answer their call by its function's name."""
        instructions = self.instructions
        out = [Message(role="system", parts=text_parts(instructions))] if instructions else []
        if isinstance(self.input, str):
            return [*out, Message(role="user", parts=text_parts(self.input))]
        names: dict[str, str] = {}  # call id -> function
        for item in self.input:
            if isinstance(item, MessageItem):
                out.append(item.message())
            elif isinstance(item, FunctionCallItem):
                names[item.call_id] = item.name
                _add_call(out, tool_call(item.name, item.arguments, item.call_id))
            elif isinstance(item, FunctionCallOutputItem):
                named: dict[str, Any] = {}  # no name for a call not in the input
                if item.call_id in names:
                    named["name"] = names[item.call_id]
                parts = _parts(item.output)
                out.append(Message(role="tool", parts=parts, tool_call_id=item.call_id, **named))
        return out

    def _template_args(self) -> dict[str, Any]:
        """The chat template's thinking switch, by the effort (none: the server's)."""
        if self.reasoning is None or self.reasoning.effort is None:
            return {}
        return {"enable_thinking": self.reasoning.effort != "none"}

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

    def _tools(self) -> list[dict[str, Any]] | None:
        functions = self.functions()
        if not functions:
            return None
        return [
            template_tool(
                t.name, t.description, t.parameters or {"type": "object", "properties": {}}
            )
            for t in functions
        ]

    def _tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if isinstance(choice, NamedFunction):
            return {"type": "function", "function": {"name": choice.name}}
        return choice

    def max_calls(self) -> int | None:
        if self.parallel_tool_calls is False:
            return 1
        return self.max_tool_calls


def _add_call(messages: list[Message], call: ToolCall) -> None:
    """``call`` joins the assistant message that ends ``messages``, or starts one."""
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant":
        calls = [*(last.tool_calls or []), call]
        messages[-1] = Message(role="assistant", parts=last.parts, tool_calls=calls)
    else:
        messages.append(Message(role="assistant", tool_calls=[call]))


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
