"""Fields an OpenAI chat or completion request may send that the cluster cannot honour: each is
a 400 naming it (never a silent 200), unless sent empty, when it means nothing and is dropped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from exo_tp.api.core.errors import ApiError
from exo_tp.api.core.sampling import KV_FIELDS, KV_WIDTH_PER_NODE


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
