"""A request body's pydantic error as the 400 every dialect sends: the most specific problem,
naming the parameter as OpenAI does."""

from __future__ import annotations

from pydantic import ValidationError

from exo_tp.api.core.errors import ApiError


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
