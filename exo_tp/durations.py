"""Durations as people and Ollama's clients write them: ``keep_alive`` and ``--keep-alive``.

Go's duration syntax (``"5m"``, ``"1h30m"``, ``"300ms"``, ``"-1m"``), which Ollama's API takes,
or a number of seconds (a JSON number, or a string of one: ``"0"``, ``"-1"``). A negative
duration means for ever.
"""

from __future__ import annotations

import math
import re

_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)")
FOREVER = -1.0


def parse_duration(value: float | int | str) -> float:
    """Seconds (``FOREVER`` for a negative duration); ValueError saying what is accepted."""
    if isinstance(value, bool):
        raise ValueError("a duration is a number of seconds or a string such as '5m'")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise ValueError("a duration must be finite")
        return FOREVER if value < 0 else float(value)
    text = value.strip()
    if _NUMBER.fullmatch(text):
        return parse_duration(float(text))
    sign, body = (-1.0, text[1:]) if text[:1] == "-" else (1.0, text.lstrip("+"))
    parts = _PART.findall(body)
    if not body or "".join(n + u for n, u in parts) != body:
        raise ValueError(
            f"invalid duration {value[:50]!r}: use seconds (300) or units (5m, 1h30m, 300ms)"
        )
    seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    return FOREVER if sign < 0 and seconds > 0 else seconds
