"""The conversation every dialect's chat request becomes: messages whose content is a list of
typed parts, their tool calls, and the tools offered, as one `Chat`. Each dialect converts its
own messages into these; only `Message.for_template`, just before the chat template renders the
prompt (chat_prompt.py), turns a message into the dict a template reads.

Parts are text or images. An image part keeps the bytes the client sent (decoded from base64,
not yet read as an image): chat_prompt.py reads and checks them off the event loop, and a model
without a vision tower refuses them there."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field

from exo_tp.api.core.strict import Passed

Role = Literal["system", "user", "assistant", "tool"]


class _Built(BaseModel):
    """Built by the dialects from values their schemas checked already."""

    model_config = ConfigDict(extra="forbid")


class _BuiltPassed(BaseModel):
    """Keeps a client's own fields: OpenAI's tool calls reach the template as sent."""

    model_config = ConfigDict(extra="allow")


class TextPart(_Built):
    type: Literal["text"] = "text"
    text: str


class ImagePart(_Built):
    """An image as the client sent it: the file's bytes (a data URL's or base64 field's), or
    the http(s) URL it named; ``detail`` is OpenAI's hint, accepted and not used."""

    type: Literal["image"] = "image"
    data: bytes | None = None
    url: str | None = None
    detail: str | None = None


# Every kind of content part a message may hold, told apart by ``type``.
Part: TypeAlias = Annotated[TextPart | ImagePart, Field(discriminator="type")]


def text_parts(text: str | None) -> list[Part]:
    """``text`` as a message's content: one text part, or none for no text."""
    return [TextPart(text=text)] if text else []


class CallFunction(_BuiltPassed):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any]  # JSON text (OpenAI, Responses) or the object itself


class ToolCall(_BuiltPassed):
    """A tool call of an earlier assistant turn, in OpenAI's shape (which templates take)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CallFunction


def tool_call(name: str, arguments: str | dict[str, Any], call_id: str | None = None) -> ToolCall:
    """A tool call as the dialects that build theirs send it to the template: with its type,
    and its id unless ``call_id`` is None (Ollama's calls have none)."""
    ids = {} if call_id is None else {"id": call_id}
    return ToolCall(**ids, type="function", function=CallFunction(name=name, arguments=arguments))


class Message(_Built):
    """One message of the conversation. Fields left unset are left out of the template's
    message (a client's explicit null is kept, as the client sent it); ``passed``: fields the
    client sent that no dialect names, for templates that read them (``reasoning_content``)."""

    role: Role
    parts: list[Part] = []
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    passed: dict[str, Any] = {}

    def text(self) -> str:
        return "".join(part.text for part in self.parts if isinstance(part, TextPart))

    def images(self) -> list[ImagePart]:
        return [part for part in self.parts if isinstance(part, ImagePart)]

    def _content(self) -> str | list[dict[str, str]]:
        """Text joined, as mlx_lm.server joins it; with images, the parts in order as
        mlx-vlm's templates take them ({"type": "image"} where each image goes)."""
        if not self.images():
            return self.text()
        return [
            {"type": "text", "text": part.text} if isinstance(part, TextPart) else {"type": "image"}
            for part in self.parts
        ]

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it: its text parts joined into ``content`` (as
        mlx_lm.server joins them), then its other fields, then the passed ones. Content a
        client left out comes last, empty, where mlx_lm.server adds it."""
        fields = self.model_dump(exclude_unset=True, exclude={"role", "parts", "passed"})
        if "parts" not in self.model_fields_set:
            return {"role": self.role, **fields, **self.passed, "content": ""}
        return {"role": self.role, "content": self._content(), **fields, **self.passed}


class FunctionSpec(Passed):
    """A function tool as OpenAI's and Ollama's requests send it (the shape templates take)."""

    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


def template_tool(name: str, description: str | None, parameters: dict[str, Any]) -> dict[str, Any]:
    """A tool as chat templates take it (OpenAI's function-tool form), from any dialect's."""
    function: dict[str, Any] = {"name": name, "parameters": parameters}
    if description:
        function["description"] = description
    return {"type": "function", "function": function}


@dataclass(frozen=True)
class Chat:
    """A chat request as every dialect asks for it, up to its rendering: the conversation, the
    tools offered (`template_tool`'s shape) and OpenAI's ``tool_choice`` over them, the
    template variables the request sets over the server's, and mlx_lm.server's role mapping
    for a model without a chat template."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    template_args: dict[str, Any] = field(default_factory=dict)
    role_mapping: dict[str, str] | None = None
