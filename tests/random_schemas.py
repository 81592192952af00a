"""Random JSON schemas for the structured-output tests: nested objects, enums, arrays and
required fields, every one bounded (string lengths, integer ranges, array sizes, no extra
properties), so that the longest JSON a schema allows is known and a token budget of that
many bytes always lets the answer finish: every answer must then parse and validate."""

from __future__ import annotations

import json
import random
from typing import Any

NAMES = ("id", "name", "kind", "tags", "size", "ok", "when", "items", "note", "level", "meta")
WORDS = ("red", "green", "blue", "x", "y", "yes", "no", "north", "south", "")


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object of 1 to 3 properties, some required, with objects nested in it (kept small:
    200 of them must run in a test's minute or two on 2 cores)."""
    names = rng.sample(NAMES, rng.randint(1, 3))
    properties = {name: _value(rng, depth) for name in names}
    return {
        "type": "object",
        "properties": properties,
        "required": [n for n in names if rng.random() < 0.6],
        "additionalProperties": False,
    }


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["string", "integer", "boolean", "enum", "array"] + (["object"] if depth < 1 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 1), "maxLength": rng.randint(1, 4)}
    if kind == "integer":
        low = rng.randint(-9, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 60)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        pool: list[Any] = [*WORDS, 0, 7, -3, True, None]
        return {"enum": rng.sample(pool, rng.randint(1, 4))}
    if kind == "array":
        item = _value(rng, 2) if depth < 1 else {"type": "integer", "minimum": 0, "maximum": 9}
        return {"type": "array", "items": item, "minItems": rng.randint(0, 1), "maxItems": 2}
    return random_schema(rng, depth + 1)


def max_bytes(schema: dict[str, Any]) -> int:
    """The longest JSON text ``schema`` allows as llguidance writes it (", " and ": ", and a
    string's character as a \\uXXXX escape at worst): a bound on its tokens."""
    if "enum" in schema:
        return max(len(json.dumps(v)) for v in schema["enum"])
    kind = schema["type"]
    if kind == "string":
        return 2 + 6 * schema["maxLength"]
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind == "boolean":
        return 5
    if kind == "array":
        return 2 + schema["maxItems"] * (max_bytes(schema["items"]) + 2)
    return 2 + sum(
        len(json.dumps(name)) + 2 + max_bytes(value) + 2
        for name, value in schema["properties"].items()
    )
