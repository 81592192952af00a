"""Anthropic Messages API request bodies, and their translation into the shared `Chat`
(exo_tp.api.core.conversation): messages of content parts, and tools in the shape chat
templates take."""

from __future__ import annotations

from collections.abc import Sequence
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
    Part,
    TextPart,
    template_tool,
    text_parts,
    tool_call,
)
from exo_tp.api.core.conversation import Message as ChatMessage
from exo_tp.api.core.images import image_bytes, image_from_url
from exo_tp.api.core.sampling import check_stops
from exo_tp.api.core.strict import Passed, Strict

MAX_STOP_SEQUENCES = 16


class _Block(Passed):
    """Blocks may carry hints such as cache_control or citations: they change no answer here."""


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str = Field(min_length=1)
    input: dict[str, Any]


class Base64Source(Strict):
    type: Literal["base64"]
    media_type: str
    data: str


class UrlSource(Strict):
    type: Literal["url"]
    url: str


class ImageBlock(_Block):
    """An image: base64 (read here), or a URL (refused unless the server fetches them)."""

    type: Literal["image"]
    source: Annotated[Base64Source | UrlSource, Field(discriminator="type")]
    _image: ImagePart | None = PrivateAttr(default=None)  # decoded once, by the validator

    @model_validator(mode="after")
    def _readable(self) -> ImageBlock:
        if isinstance(self.source, Base64Source):  # bad base64 or URL: the block's 400
            self._image = ImagePart(data=image_bytes(self.source.data, "the image's data"))
        else:
            self._image = image_from_url(self.source.url)
        return self

    def part(self) -> ImagePart:
        assert self._image is not None  # set by the validator
        return self._image


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock] | None = None
    is_error: bool | None = None

    def message(self) -> ChatMessage:
        """The result as a ``tool`` message answering its call."""
        content = self.content
        parts = _texts(content) if isinstance(content, list) else text_parts(content)
        return ChatMessage(role="tool", parts=parts, tool_call_id=self.tool_use_id)


class ThinkingBlock(_Block):
    """Reasoning of an earlier turn: not shown to the model again (as Anthropic does)."""

    type: Literal["thinking", "redacted_thinking"]


Block = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock


def _texts(blocks: Sequence[Block]) -> list[Part]:
    """The text and image blocks among ``blocks``, as parts in their order."""
    return [
        TextPart(text=b.text) if isinstance(b, TextBlock) else b.part()
        for b in blocks
        if isinstance(b, TextBlock | ImageBlock)
    ]


_BLOCKS: dict[str, type[BaseModel]] = {
    "text": TextBlock,
    "image": ImageBlock,
    "tool_use": ToolUseBlock,
    "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock,
    "redacted_thinking": ThinkingBlock,
}


class OutputConfig(Strict):
    effort: str | None = None  # a hint for thinking models; this cluster's answer is the same
    format: None = None  # structured (JSON schema) output needs constrained decoding: not here


class Message(Strict):
    # Claude Code sends reminders as system messages inside the conversation: each is a
    # system message of the chat template where it stands
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]
    # a per-turn effort hint (Claude Code's per-turn control): the answer is the same
    output_config: OutputConfig | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _blocks(cls, content: Any) -> Any:
        """Each block by its ``type``, with a clear error for kinds this cluster lacks."""
        if not isinstance(content, list):
            return content
        blocks = []
        for i, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            model = _BLOCKS.get(kind) if isinstance(kind, str) else None
            if model is None:
                raise ValueError(
                    f"content block {i} of type {kind!r} is not supported: this "
                    "cluster takes text, image, tool_use and tool_result blocks"
                )
            try:
                blocks.append(model.model_validate(block))
            except ValidationError as error:
                first = error.errors()[0]
                where = ".".join(str(p) for p in first["loc"])
                raise ValueError(f"content block {i}: {where}: {first['msg']}") from None
        return blocks

    def converted(self) -> list[ChatMessage]:
        """The message as the shared messages: its text blocks as text parts (thinking is not
        shown again), tool results as ``tool`` messages before it, tool uses as its calls."""
        content = self.content
        said = ChatMessage(
            role=self.role,
            parts=text_parts(content) if isinstance(content, str) else _texts(content),
        )
        if self.role == "system":  # Claude Code sends empty ones, which say nothing
            return [said] if said.text() else []
        if isinstance(content, str):
            return [said]
        if self.role == "user":
            results = [b.message() for b in content if isinstance(b, ToolResultBlock)]
            return [*results, said] if said.parts or not results else results
        calls = [tool_call(b.name, b.input, b.id) for b in content if isinstance(b, ToolUseBlock)]
        if calls:
            return [ChatMessage(role="assistant", parts=said.parts, tool_calls=calls)]
        return [said]


class CustomTool(_Block):
    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any]
    # a deferred tool is not shown to the model until a tool search loads it (as Anthropic
    # does): here it is left out of the prompt
    defer_loading: bool | None = None


class ServerTool(_Block):
    """A built-in tool (web_search_*, code_execution_*, bash_*, text_editor_*, computer_*...):
    its schema lives in Anthropic's servers, so the model here never sees it (left_out.py)."""

    type: str
    name: str | None = None


def _tool_kind(tool: Any) -> str:
    """A tool by its ``type``: a custom one (no type or "custom") or a built-in one."""
    kind = tool.get("type") if isinstance(tool, dict) else getattr(tool, "type", None)
    return "custom" if kind in (None, "custom") else "server"


AnyTool = Annotated[
    Annotated[CustomTool, Tag("custom")] | Annotated[ServerTool, Tag("server")],
    Discriminator(_tool_kind),
]


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("a tool_choice of type 'tool' needs a 'name'")
        return self


class Thinking(Strict):
    """``enabled`` turns the chat template's ``enable_thinking`` on, ``disabled`` off;
    ``adaptive`` (the model decides) leaves the server's --chat-template-args as they are. A
    model whose template cannot think simply answers. ``budget_tokens`` caps the thinking
    (with ``enabled``: thinking_budget.py); ``display: omitted`` sends no thinking text."""

    type: Literal["disabled", "enabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)
    display: Literal["summarized", "omitted"] | None = None


class ContextEdit(_Block):
    # each edit's own settings (keep, trigger, clear_at_least...) are accepted with it
    type: str


class ContextManagement(Strict):
    """Accepted; nothing is edited: earlier thinking is never shown to the model again (what
    clear_thinking asks), and tool results are kept (the conversation is rendered whole)."""

    edits: list[ContextEdit] = []


class Metadata(Strict):
    user_id: str | None = None


class _Conversation(Strict):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnyTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    context_management: ContextManagement | None = None

    def left_out(self) -> list[str]:
        """The built-in tools the model will not see (their names, else their types)."""
        return [t.name or t.type for t in self.tools or [] if isinstance(t, ServerTool)]

    def _template_args(self) -> dict[str, Any]:
        """The chat template's thinking switch, as ``thinking`` asks (none: the server's)."""
        if self.thinking is None or self.thinking.type == "adaptive":
            return {}
        return {"enable_thinking": self.thinking.type == "enabled"}

    def thinking_budget(self) -> int | None:
        if self.thinking is None or self.thinking.type != "enabled":
            return None
        return self.thinking.budget_tokens

    def shows_thinking(self) -> bool:
        return self.thinking is None or self.thinking.display != "omitted"

    def chat(self) -> Chat:
        """The conversation, its tools and their choice, and the thinking switch."""
        return Chat(
            messages=self._messages(),
            tools=self._tools(),
            tool_choice=self._tool_choice(),
            template_args=self._template_args(),
        )

    def _messages(self) -> list[ChatMessage]:
        out: list[ChatMessage] = []
        if self.system:
            system = self.system
            text = system if isinstance(system, str) else "\n".join(b.text for b in system)
            out.append(ChatMessage(role="system", parts=text_parts(text)))
        for message in self.messages:
            out += message.converted()
        return out

    def _tools(self) -> list[dict[str, Any]] | None:
        shown = [t for t in self.tools or [] if isinstance(t, CustomTool) and not t.defer_loading]
        if not shown:
            return None
        return [template_tool(t.name, t.description, t.input_schema) for t in shown]

    def _tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if choice is None:
            return None
        if choice.type == "tool":
            return {"type": "function", "function": {"name": choice.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[choice.type]

    @model_validator(mode="after")
    def _non_empty(self) -> _Conversation:
        """Anthropic's rule: every user and assistant message has content, except a final
        assistant message (a prefill of the answer, which may be empty). System messages
        inside the conversation are Claude Code's, which sends empty ones: they are skipped."""
        for i, message in enumerate(self.messages):
            last_reply = i == len(self.messages) - 1 and message.role == "assistant"
            empty = message.content == "" or message.content == []
            if empty and not last_reply and message.role != "system":
                raise ValueError(
                    f"messages.{i}: all messages must have non-empty content except for the "
                    "optional final assistant message"
                )
        return self


class CountTokensRequest(_Conversation):
    pass


class MessagesRequest(_Conversation):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    output_config: OutputConfig | None = None
    # bookkeeping and hints that change nothing in the answer
    metadata: Metadata | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    speed: str | None = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, stops: list[str] | None) -> list[str] | None:
        check_stops(stops or [], MAX_STOP_SEQUENCES)
        return stops
