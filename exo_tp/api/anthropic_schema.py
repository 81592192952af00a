"""Anthropic Messages API request bodies, and their translation into the chat messages and tools
(OpenAI's shape) that chat templates take."""

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
    model_validator,
)

from exo_tp.api.openai_schema import MAX_STOP_CHARS, template_tool

MAX_STOP_SEQUENCES = 16


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class _Block(BaseModel):
    # blocks may carry hints such as cache_control or citations: they change no answer here
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(block.text for block in self.content)


class ThinkingBlock(_Block):
    """Reasoning of an earlier turn: not shown to the model again (as Anthropic does)."""

    type: Literal["thinking", "redacted_thinking"]


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
_BLOCKS: dict[str, type[BaseModel]] = {
    "text": TextBlock,
    "tool_use": ToolUseBlock,
    "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock,
    "redacted_thinking": ThinkingBlock,
}


class OutputConfig(_Strict):
    effort: str | None = None  # a hint for thinking models; this cluster's answer is the same
    format: None = None  # structured (JSON schema) output needs constrained decoding: not here


class Message(_Strict):
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
                    "cluster serves a text-only model (text, tool_use and "
                    "tool_result blocks)"
                )
            try:
                blocks.append(model.model_validate(block))
            except ValidationError as error:
                first = error.errors()[0]
                where = ".".join(str(p) for p in first["loc"])
                raise ValueError(f"content block {i}: {where}: {first['msg']}") from None
        return blocks

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text for b in self.content if isinstance(b, TextBlock))


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


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("a tool_choice of type 'tool' needs a 'name'")
        return self


class Thinking(_Strict):
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


class ContextManagement(_Strict):
    """Accepted; nothing is edited: earlier thinking is never shown to the model again (what
    clear_thinking asks), and tool results are kept (the conversation is rendered whole)."""

    edits: list[ContextEdit] = []


class Metadata(_Strict):
    user_id: str | None = None


class _Conversation(_Strict):
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

    def template_args(self, defaults: dict[str, Any]) -> dict[str, Any]:
        """The server's chat template arguments, with thinking switched as ``thinking`` asks."""
        args = dict(defaults)
        if self.thinking is not None and self.thinking.type != "adaptive":
            args["enable_thinking"] = self.thinking.type == "enabled"
        return args

    def thinking_budget(self) -> int | None:
        if self.thinking is None or self.thinking.type != "enabled":
            return None
        return self.thinking.budget_tokens

    def shows_thinking(self) -> bool:
        return self.thinking is None or self.thinking.display != "omitted"

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat-template messages: tool results become ``tool``
        messages, tool uses the assistant's ``tool_calls``."""
        out: list[dict[str, Any]] = []
        if self.system:
            system = (
                self.system
                if isinstance(self.system, str)
                else "\n".join(b.text for b in self.system)
            )
            out.append({"role": "system", "content": system})
        for message in self.messages:
            text = message.text()
            if message.role == "system":
                if text:  # Claude Code sends empty ones, which say nothing
                    out.append({"role": "system", "content": text})
                continue
            if isinstance(message.content, str):
                out.append({"role": message.role, "content": text})
                continue
            if message.role == "user":
                out += [
                    {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
                    for b in message.content
                    if isinstance(b, ToolResultBlock)
                ]
                if text or not any(isinstance(b, ToolResultBlock) for b in message.content):
                    out.append({"role": "user", "content": text})
                continue
            calls = [
                {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                for b in message.content
                if isinstance(b, ToolUseBlock)
            ]
            reply: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                reply["tool_calls"] = calls
            out.append(reply)
        return out

    def chat_tools(self) -> list[dict[str, Any]] | None:
        shown = [t for t in self.tools or [] if isinstance(t, CustomTool) and not t.defer_loading]
        if not shown:
            return None
        return [template_tool(t.name, t.description, t.input_schema) for t in shown]

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
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
        if stops and len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if stops and any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences are at most {MAX_STOP_CHARS} characters")
        return stops
