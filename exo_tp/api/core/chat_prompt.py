"""Prompts as mlx_lm.server builds them: a conversation (a `Chat`, with its tools) through the
model's chat template, or a plain completion prompt, into token ids; plus where the answer starts
(normal text, reasoning, or inside a forced tool call)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError
from mlx_lm.server import convert_chat, process_message_content
from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo_tp.api.core.conversation import Chat, Message
from exo_tp.api.core.errors import ApiError
from exo_tp.api.core.images import read_images
from exo_tp.api.core.structured import tool_call
from exo_tp.vision.families import NoImages
from exo_tp.wire.runtime import Constraint
from exo_tp.wire.vision import VisionPrompt

if TYPE_CHECKING:
    from exo_tp.api.backend import Backend
    from exo_tp.api.core.image_fetch import ImageUrlPolicy
    from exo_tp.vision.prompt import ImagePrompter

# What rendering a client's conversation through the model's template raises when the template
# refuses it: the template's own raise_exception or an undefined name (TemplateError), a value
# of the wrong type for it ("can only concatenate str", or chat_template_kwargs that clash with
# the renderer's arguments: TypeError), transformers' checks of the arguments (ValueError), a
# lookup or a sum on the client's values (LookupError, ArithmeticError: also the sandbox's
# "range too big"). The client sent it: a 400. Anything else is our bug: the routes' 500,
# logged with its traceback.
TEMPLATE_REFUSALS = (TemplateError, TypeError, ValueError, LookupError, ArithmeticError)


@dataclass(frozen=True)
class ToolUse:
    """What a request says about tools: the definitions rendered into the prompt (OpenAI
    shape), and whether a tool call must come first (``tool_choice`` "required" or named)."""

    tools: list[dict[str, Any]] | None = None
    forced: bool = False


@dataclass(frozen=True)
class Prompt:
    tokens: list[int]
    vision: VisionPrompt | None = None  # its images, as the ranks take them
    initial_state: str = "normal"  # the answer's first state: normal, reasoning or tool
    tools: list[dict[str, Any]] | None = None  # tool calls in the answer are parsed for these
    constraint: Constraint | None = None  # a forced tool call's grammar (its arguments parse)


def choose_tools(
    tools: list[dict[str, Any]] | None,
    choice: str | dict[str, Any] | None,
    tokenizer: TokenizerWrapper,
) -> ToolUse:
    """OpenAI's ``tool_choice`` over the request's tools: "none" renders none; "required"
    makes the answer start with a tool call; a named function also offers only that one."""
    if choice == "none" or not tools:
        if isinstance(choice, dict) or choice == "required":
            raise ApiError(
                400, "Invalid value for 'tool_choice': it requires 'tools'.", param="tool_choice"
            )
        return ToolUse()
    if not tokenizer.has_tool_calling:
        raise ApiError(
            400,
            "This model does not support tools: its chat template has no tool "
            "calling format that mlx-lm knows.",
            param="tools",
            code="tools_not_supported",
        )
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        named = [t for t in tools if t["function"]["name"] == name]
        if not named:
            raise ApiError(
                400,
                f"Invalid value for 'tool_choice': no tool named {name!r} in 'tools'.",
                param="tool_choice",
            )
        return ToolUse(named, forced=True)
    return ToolUse(tools, forced=choice == "required")


def served_chat_prompt(node: Backend, chat: Chat) -> Prompt:
    """``chat``'s prompt for the model ``node`` serves: its tokenizer, template variables,
    image processor and image URL policy (every dialect's chat path)."""
    defaults = node.defaults
    return chat_prompt(
        node.tokenizer, chat, defaults.chat_template_args, node.images, defaults.image_urls
    )


def chat_prompt(
    tokenizer: TokenizerWrapper,
    chat: Chat,
    server_args: dict[str, Any],
    images: ImagePrompter | NoImages | None = None,
    image_urls: ImageUrlPolicy | None = None,
) -> Prompt:
    """``chat``'s prompt: its tools as its tool choice offers them, rendered with the server's
    template variables (--chat-template-args) under the request's own; its images read and
    checked, and made the ranks' input by ``images`` (the model's processor; None: the model
    takes no images, and an image part is a 400); an image URL fetched as ``image_urls``
    allows (the server's --image-urls; None: refused)."""
    use = choose_tools(chat.tools, chat.tool_choice, tokenizer)
    args = {**server_args, **chat.template_args}
    refusal = "it has no vision tower" if images is None else None
    if isinstance(images, NoImages):
        refusal, images = images.reason, None
    pictures = read_images(chat.messages, refusal, image_urls)
    if pictures and images is not None:
        return _image_prompt(tokenizer, chat.messages, use, args, images, pictures)
    return render_chat(tokenizer, chat.messages, use, args, chat.role_mapping)


def _image_prompt(
    tokenizer: TokenizerWrapper,
    conversation: Sequence[Message],
    use: ToolUse,
    template_args: dict[str, Any],
    images: ImagePrompter,
    pictures: list[Any],
) -> Prompt:
    """The template's text (image parts where the images go), through mlx-vlm's processor."""
    messages = [message.for_template() for message in conversation]
    lists = {i: m["content"] for i, m in enumerate(messages) if isinstance(m.get("content"), list)}
    for i in lists:  # mlx_lm.server's pass reads text lists only; its tool calls still apply
        messages[i]["content"] = ""
    process_message_content(messages)
    for i, content in lists.items():
        messages[i]["content"] = content
    text = _rendered(
        tokenizer,
        messages,
        tools=use.tools,
        tokenize=False,
        add_generation_prompt=True,
        **template_args,
    )
    try:
        tokens, vision = images.prompt(text, pictures)
    except ValueError as error:
        raise ApiError(
            400, f"The images could not be processed: {error}", param="messages"
        ) from None
    return _finish(tokenizer, tokens, use, vision)


def render_chat(
    tokenizer: TokenizerWrapper,
    conversation: Sequence[Message],
    use: ToolUse,
    template_args: dict[str, Any],
    role_mapping: dict[str, str] | None = None,
) -> Prompt:
    """Token ids of the conversation, rendered exactly as mlx_lm.server renders it."""
    messages = [message.for_template() for message in conversation]
    process_message_content(messages)  # tool-call arguments as objects, as mlx_lm.server has
    if not tokenizer.has_chat_template:
        tokens = tokenizer.encode(convert_chat(messages, role_mapping))
        return Prompt(tokens=_token_list(tokens))
    tokens = _rendered(
        tokenizer,
        messages,
        tools=use.tools,
        tokenize=True,
        add_generation_prompt=True,
        **template_args,
    )
    return _finish(tokenizer, _token_list(tokens), use)


def _rendered(tokenizer: TokenizerWrapper, messages: list[dict[str, Any]], **options: Any) -> Any:
    """The chat template's output; its refusal of the client's values is a 400."""
    try:
        return tokenizer.apply_chat_template(messages, **options)
    except TEMPLATE_REFUSALS as error:
        message = str(error).strip() or type(error).__name__
        raise ApiError(
            400,
            f"The model's chat template rejected the request: {message[:500]}",
            param="messages",
        ) from None


def _finish(
    tokenizer: TokenizerWrapper, tokens: list[int], use: ToolUse, vision: VisionPrompt | None = None
) -> Prompt:
    """Where the answer starts; a forced tool call's opening and grammar."""
    state = _initial_state(tokenizer, tokens)
    if use.forced and use.tools:  # the answer starts inside a tool call, and is one
        tokens = tokens + list(tokenizer.tool_call_start_tokens)
        constraint = tool_call(tokenizer, use.tools)
        return Prompt(tokens, vision, "tool", use.tools, constraint)
    return Prompt(tokens=tokens, vision=vision, initial_state=state, tools=use.tools)


def _initial_state(tokenizer: TokenizerWrapper, tokens: list[int]) -> str:
    """mlx_lm.server's choice: reasoning when the prompt leaves a thinking block open."""
    state = "normal"
    if tokenizer.has_thinking and tokenizer.rfind_think_start(tokens) > tokenizer.rfind_think_end(
        tokens
    ):
        state = "reasoning"
    return tokenizer.response_initial_state or state


def _token_list(tokens: Any) -> list[int]:
    if isinstance(tokens, dict):  # chat_template_kwargs asked for a dict
        tokens = tokens.get("input_ids")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise ApiError(
            400,
            "The model's chat template did not give token ids; check chat_template_kwargs.",
            param="chat_template_kwargs",
        )
    return list(tokens)


def completion_prompt(tokenizer: TokenizerWrapper, prompt: str | list[int]) -> list[int]:
    """A plain completion's token ids: its text encoded as mlx_lm.server does, or the ids."""
    if isinstance(prompt, list):
        return list(prompt)
    return list(tokenizer.encode(prompt))
