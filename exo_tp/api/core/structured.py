"""Structured outputs as the dialects ask for them, made `Constraint`s: OpenAI's
``response_format``, the Responses API's ``text.format``, Ollama's ``format``, and a forced
tool call (``tool_choice`` "required" or named) in the template's call syntax. Each is
compiled here first (`exo_tp.grammar.compiler`), so a schema llguidance cannot compile (or
cannot decode from its start) is a 400 naming its field before any work; one whose grammar
fails later, while decoding, fails the answer with an error the client sees
(`decoding_failure`), never a "stop" after text that is no value."""

from __future__ import annotations

import json
from typing import Any

from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo_tp.api.core.errors import ApiError
from exo_tp.grammar.compiler import GrammarError, grammars_for
from exo_tp.wire.runtime import Constraint

# OpenAI's json_object and Ollama's "json": any JSON object (OpenAI's mode answers objects).
ANY_OBJECT = Constraint(kind="json_schema", grammar='{"type": "object"}')
# The whitespace of a call's JSON inside a lark grammar (JSON_OPTIONS of a plain schema).
_CALL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# mlx-lm tool parsers whose calls are `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`
# (Qwen 2.5/3, SmolLM3, Hermes and the templates mlx-lm reads as "json_tools").
_JSON_CALL_PARSERS = ("mlx_lm.tool_parsers.json_tools",)


def response_format(kind: str, schema: Any, param: str) -> Constraint | None:
    """The constraint of a format as OpenAI names them ("text", "json_object",
    "json_schema" with its ``schema``; none given: any JSON value)."""
    if kind == "json_object":
        return ANY_OBJECT
    if kind == "json_schema":
        return json_schema(True if schema is None else schema, param)
    return None


def json_schema(schema: Any, param: str) -> Constraint:
    """A client's JSON schema (an object, or true / false as JSON Schema allows)."""
    if not isinstance(schema, dict | bool):
        message = f"Invalid value for '{param}': a JSON schema is an object."
        raise ApiError(400, message, param=param)
    return Constraint(kind="json_schema", grammar=json.dumps(schema))


def tool_call(tokenizer: TokenizerWrapper, tools: list[dict[str, Any]]) -> Constraint:
    """A forced tool call: the prompt ends with the call marker; the answer is one call of
    one of ``tools`` (OpenAI's shape) whose arguments match its parameters, then the end
    marker. Templates whose call syntax is not a JSON object in markers get a 400."""
    parser = getattr(tokenizer.tool_parser, "__module__", None)
    if parser not in _JSON_CALL_PARSERS:
        raise ApiError(
            400,
            "Unsupported value for 'tool_choice': a required or named tool call is decoded "
            "under a grammar of the template's call syntax, and this model's "
            f"({parser or 'unknown'}) is not one this server can write one for; "
            "send tool_choice 'auto'.",
            param="tool_choice",
            code="unsupported_parameter",
        )
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool["function"]["name"]},
                "arguments": tool["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema = {**({"anyOf": calls} if len(calls) > 1 else calls[0]), "x-guidance": _CALL_JSON}
    end = json.dumps("\n" + tokenizer.tool_call_end)
    return Constraint(kind="lark", grammar=f'start: "\\n" %json {json.dumps(schema)} {end}\n')


def check(tokenizer: TokenizerWrapper, vocab_size: int, constraint: Constraint, param: str) -> None:
    """Compile ``constraint`` (cached for the conductor's process too when it is this one);
    a 400 naming ``param`` when llguidance cannot."""
    try:
        grammars_for(tokenizer, vocab_size).compile(constraint)
    except GrammarError as error:
        raise ApiError(
            400,
            f"Invalid schema for '{param}': {str(error)[:1000]}",
            param=param,
            code="invalid_json_schema",
        ) from None


def decoding_failure(error: ApiError, param: str | None = None) -> ApiError:
    """``error`` as the client gets it: the conductor's failure of a request whose grammar
    failed while decoding is the schema's (a 400 naming ``param`` where it is known, or an
    error event once a stream is open), not the server's 500; any other error is itself."""
    if error.code != "grammar_failed":
        return error
    return ApiError(
        400,
        f"Invalid schema{f' for {param!r}' if param else ''}: {error.message}; simplify the schema",
        param=param,
        code="invalid_json_schema",
    )
