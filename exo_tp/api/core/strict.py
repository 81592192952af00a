"""The two kinds of request model every dialect builds on: strict ones, whose unknown fields are
a 400, and passed-on ones, whose unknown fields reach the chat template (or are harmless
hints), their known fields checked all the same."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    # strict: "10" is not an integer and "true" is not a boolean, as in OpenAI's API
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class Passed(BaseModel):
    """Known fields are checked, any others are kept: templates read fields such as
    ``reasoning_content``, and clients send back hints (ids, ``cache_control``) that change
    nothing."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
