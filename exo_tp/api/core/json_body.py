"""Request bodies as JSON the rest of the node can trust: no NaN or Infinity, no nesting deeper
than any request needs, and no string the tokenizer or the wire would choke on."""

from __future__ import annotations

import json
import math
from typing import Any

from exo_tp.api.core.errors import ApiError

MAX_DEPTH = 64  # the deepest real requests (tool parameter schemas) stay far below this


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # 1e999 parses as infinity
        raise ValueError(f"the number {text[:40]} is too large")
    return value


def parse_json(raw: bytes) -> Any:
    """The body as Python values, or a 400 that says what is wrong (and where)."""
    try:
        value = json.loads(raw, parse_constant=_no_constants, parse_float=_finite)
    except RecursionError:
        raise ApiError(400, f"request body is nested more than {MAX_DEPTH} levels deep") from None
    except (ValueError, UnicodeDecodeError) as bad:  # JSONDecodeError, huge integers, NaN
        raise ApiError(400, f"request body is not valid JSON: {bad}") from None
    check_tree(value)
    return value


def _path(parts: tuple[str | int, ...]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _bad_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate such as "\ud800"
        return True
    return False


def check_tree(value: Any) -> None:
    """Walk without recursion: depth, and strings that are not valid Unicode text."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        item, where = stack.pop()
        if len(where) > MAX_DEPTH:
            raise ApiError(
                400,
                f"request body is nested more than {MAX_DEPTH} levels deep",
                param=_path(where[:3]) or None,
            )
        if isinstance(item, str):
            if _bad_text(item):
                param = _path(where) or None
                raise ApiError(
                    400,
                    f"Invalid value for '{param}': the text contains a lone "
                    "UTF-16 surrogate, which is not a character",
                    param=param,
                )
        elif isinstance(item, dict):
            for key, child in item.items():
                if _bad_text(key):
                    raise ApiError(
                        400,
                        "a key of the request body contains a lone UTF-16 surrogate",
                        param=_path(where) or None,
                    )
                stack.append((child, (*where, key)))
        elif isinstance(item, list):
            stack.extend((child, (*where, i)) for i, child in enumerate(item))
