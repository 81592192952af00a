"""Training files checked line by line before any job starts (pure: no MLX).

A file is JSONL in one of the formats mlx-lm's trainer reads (mlx_lm.tuner.datasets), every line
in the same one, which is the first line's: OpenAI's chat format (``{"messages": [...]}``,
optionally with ``tools``), mlx-lm's completions (``{"prompt": ..., "completion": ...}``) or
text (``{"text": ...}``). A bad line is named by its number (from 1), so a client can fix it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from exo_tp.errors import ExoTpError

Format = Literal["chat", "completions", "text"]


class DataError(ExoTpError):
    def __init__(self, message: str, line: int | None = None):
        super().__init__(f"line {line}: {message}" if line is not None else message)
        self.line = line


class _Line(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI's files carry e.g. "weight" per message


class Message(_Line):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | None = None


class ChatLine(_Line):
    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None


class CompletionsLine(_Line):
    prompt: str
    completion: str


class TextLine(_Line):
    text: str = Field(min_length=1)


LINES: dict[Format, type[_Line]] = {
    "chat": ChatLine,
    "completions": CompletionsLine,
    "text": TextLine,
}


def format_of(row: dict[str, Any]) -> Format | None:
    """The format mlx-lm's create_dataset picks for a file whose first line is ``row``."""
    if "prompt" in row and "completion" in row:
        return "completions"
    if "messages" in row:
        return "chat"
    if "text" in row:
        return "text"
    return None


def _where(error: ValidationError) -> str:
    first = error.errors()[0]
    place = ".".join(str(p) for p in first["loc"])
    return f"{place}: {first['msg']}" if place else first["msg"]


def check_jsonl(raw: bytes) -> tuple[Format, int]:
    """The file's format and number of examples; DataError naming the first bad line."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        bad_line = raw[: error.start].count(b"\n") + 1
        raise DataError("not UTF-8 text", bad_line) from None
    fmt: Format | None = None
    count = 0
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as error:
            raise DataError(f"not valid JSON ({error})", number) from None
        if not isinstance(row, dict):
            raise DataError("each line must be a JSON object", number)
        if fmt is None:
            fmt = format_of(row)
            if fmt is None:
                raise DataError(
                    "unknown format: a line needs 'messages' (chat), 'prompt' and "
                    "'completion', or 'text'",
                    number,
                )
        elif format_of(row) != fmt:
            raise DataError(f"not in the {fmt} format of the first line", number)
        try:
            LINES[fmt].model_validate(row)
        except ValidationError as error:
            raise DataError(_where(error), number) from None
        count += 1
    if count == 0:
        raise DataError("the file holds no examples")
    assert fmt is not None
    return fmt, count


def epoch_steps(examples: int, batch_size: int) -> int:
    """Optimizer steps in one pass over ``examples`` (mlx-lm drops a last partial batch)."""
    return examples // batch_size
