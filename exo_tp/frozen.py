"""The base of every serializable planning model: immutable, no unknown fields; and replace(),
the one way to change one (validated, unlike ``model_copy(update=...)``)."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict

M = TypeVar("M", bound=BaseModel)


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def replace(model: M, **changes: Any) -> M:
    """``model`` with ``changes``, validated like a new one: a bad value in a Literal or a
    constrained field raises ValidationError instead of riding along. Fields left unset stay
    unset (``model_dump(exclude_unset=True)`` reads as with ``model_copy``)."""
    data = {name: getattr(model, name) for name in model.model_fields_set}
    return type(model).model_validate({**data, **changes})
