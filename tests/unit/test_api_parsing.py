"""The API's pure parts, each against an independent reference: request bodies (malformed JSON
a worker could choke on), the answer stream split into content and tool calls (against the
tool calls written into the text), per-token log-probabilities (against mlx_lm.server's
formatter) and token bytes (against the text they spell); and whose fault a failure is (a
template refusing the client's conversation, a parser refusing the model's text, or our bug)."""

from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.server import _format_top_logprobs
from mlx_lm.tokenizer_utils import load as load_tokenizer
from tool_model import write_tool_model

from exo_tp.api.core import answer_stream
from exo_tp.api.core.answer_stream import AnswerStream
from exo_tp.api.core.chat_prompt import Prompt, ToolUse, render_chat
from exo_tp.api.core.conversation import Message, TextPart
from exo_tp.api.core.errors import ApiError
from exo_tp.api.core.json_body import MAX_DEPTH, parse_json
from exo_tp.api.core.token_text import TokenText
from exo_tp.runtime.sampling import token_logprob


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested"),
        (json.dumps({"a": [[[[[[[[[[[[[[1]]]]]]]]]]]]]] * 5}).encode(), None),
        (b'{"temperature": NaN}', "NaN"),
        (b'{"temperature": -Infinity}', "Infinity"),
        (b'{"temperature": 1e999}', "too large"),
        (b'{"seed": ' + b"9" * 5000 + b"}", "not valid JSON"),
        (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "surrogate"),
        (b'{"stop": ["ok", "a\\udfffb"]}', "surrogate"),
        (b'{"\\ud800": 1}', "surrogate"),
        (b"\xff\xfe", "not valid JSON"),
    ],
)
def test_bodies_a_worker_could_choke_on_are_400(raw: bytes, words: str | None) -> None:
    if words is None:  # nesting well within the limit is fine
        assert parse_json(raw)
        return
    with pytest.raises(ApiError) as caught:
        parse_json(raw)
    assert caught.value.status == 400 and words in caught.value.message


def test_depth_limit_names_where() -> None:
    deep: object = "x"
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(ApiError) as caught:
        parse_json(json.dumps({"tools": deep}).encode())
    assert caught.value.param == "tools[0][0]"
    with pytest.raises(ApiError) as caught:
        parse_json(b'{"messages": [{"role": "user", "content": "\\ud800"}]}')
    assert caught.value.param == "messages[0].content"


@pytest.fixture(scope="module")
def tool_tokenizer(default_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    folder = write_tool_model(tmp_path_factory.mktemp("tool-model"), default_models["smollm2-135m"])
    return load_tokenizer(folder)


CALLS = [
    {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
    {"name": "get_time", "arguments": {"zone": "Europe/Paris"}},
]
TEXT = (
    "Let me check. <tool_call>\n" + json.dumps(CALLS[0]) + "\n</tool_call>"
    "<tool_call>\n" + json.dumps(CALLS[1]) + "\n</tool_call>"
)


def _token_stream(tokenizer, text: str) -> list[str]:
    """The text as a worker streams it: token by token through mlx-lm's detokenizer."""
    detokenizer = tokenizer.detokenizer
    pieces = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        detokenizer.add_token(token)
        pieces.append(detokenizer.last_segment)
    detokenizer.finalize()
    pieces.append(detokenizer.last_segment)
    return pieces


@pytest.mark.parametrize("streaming", [False, True])
def test_tool_calls_come_out_of_the_token_stream(tool_tokenizer, streaming: bool) -> None:
    assert tool_tokenizer.has_tool_calling
    prompt = Prompt(
        tokens=[1], tools=[{"type": "function", "function": {"name": c["name"]}} for c in CALLS]
    )
    answer = AnswerStream(tool_tokenizer, prompt, streaming=streaming)
    content, calls = "", []
    for piece in [answer.feed(text) for text in _token_stream(tool_tokenizer, TEXT)] + [
        answer.finish("stop")
    ]:
        content += piece.content
        calls += piece.tool_calls
    assert content == "Let me check. "
    assert [
        {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
        for c in calls
    ] == CALLS
    assert all(c["type"] == "function" and c["id"] for c in calls)
    assert [c.get("index") for c in calls] == ([0, 1] if streaming else [None, None])
    assert answer.finish_reason("stop") == "tool_calls"


def test_without_tools_the_call_stays_text(tool_tokenizer) -> None:
    answer = AnswerStream(tool_tokenizer, Prompt(tokens=[1]), streaming=True)
    pieces = [answer.feed(t) for t in _token_stream(tool_tokenizer, TEXT)]
    pieces.append(answer.finish("stop"))
    assert "".join(p.content for p in pieces) == TEXT
    assert not any(p.tool_calls for p in pieces)
    assert answer.finish_reason("stop") == "stop"


def test_one_call_when_parallel_calls_are_off(tool_tokenizer) -> None:
    prompt = Prompt(tokens=[1], tools=[])
    answer = AnswerStream(tool_tokenizer, prompt, streaming=False, max_calls=1)
    calls = [c for t in _token_stream(tool_tokenizer, TEXT) for c in answer.feed(t).tool_calls]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


class _FailingParser:
    """A ToolCallFormatter stand-in that raises ``error`` on any call text."""

    error: Exception = RuntimeError()

    def __init__(self, *args: Any) -> None:
        pass

    def __call__(self, texts: list[str]) -> list[dict[str, Any]]:
        raise self.error


@pytest.mark.parametrize(
    ("error", "level", "traceback"),
    [
        (AttributeError("'NoneType' object has no attribute 'group'"), logging.WARNING, False),
        (KeyError("arguments"), logging.WARNING, False),
        (RuntimeError("a bug of the parser's"), logging.ERROR, True),
    ],
)
def test_a_call_the_parser_cannot_read_is_dropped_and_a_bug_logged_as_one(
    tool_tokenizer, monkeypatch, caplog, error: Exception, level: int, traceback: bool
) -> None:
    monkeypatch.setattr(_FailingParser, "error", error)
    monkeypatch.setattr(answer_stream, "ToolCallFormatter", _FailingParser)
    answer = AnswerStream(tool_tokenizer, Prompt(tokens=[1], tools=[]), streaming=False)
    with caplog.at_level(logging.WARNING, logger=answer_stream.__name__):
        pieces = [answer.feed(t) for t in _token_stream(tool_tokenizer, TEXT)]
    assert "".join(p.content for p in pieces) == "Let me check. "
    assert not any(p.tool_calls for p in pieces)
    assert {(r.levelno, r.exc_info is not None) for r in caplog.records} == {(level, traceback)}


def test_a_template_refusal_is_the_clients_400_and_our_bug_is_no_400(tool_tokenizer) -> None:
    with pytest.raises(ApiError) as caught:  # the template adds a str and the client's None
        render_chat(tool_tokenizer, HELLO_CHAT, ToolUse(), {"system_note": None})
    assert (caught.value.status, caught.value.param) == (400, "messages")
    assert "can only concatenate str" in caught.value.message

    def broken(*args: Any, **kwargs: Any) -> list[int]:
        raise RuntimeError("a bug of ours")

    ours = SimpleNamespace(has_chat_template=True, apply_chat_template=broken)
    with pytest.raises(RuntimeError, match="a bug of ours"):  # the routes' logged 500
        render_chat(ours, HELLO_CHAT, ToolUse(), {})  # type: ignore[arg-type]


def test_token_logprob_matches_mlx_lm_server() -> None:
    mx.random.seed(3)
    logprobs = mx.log(mx.softmax(mx.random.normal((1, 1000)) * 3, axis=-1))
    ours = token_logprob(logprobs, 17, 5)

    class Ids:  # mlx_lm.server's formatter also names each token; any names do here
        @staticmethod
        def convert_ids_to_tokens(ids: list[int]) -> list[str]:
            return [str(i) for i in ids]

    reference = _format_top_logprobs(logprobs[0], 5, Ids())
    assert ours.logprob == pytest.approx(logprobs[0, 17].item())
    assert {t for t, _ in ours.top} == {r["id"] for r in reference}
    assert dict(ours.top) == pytest.approx({r["id"]: r["logprob"] for r in reference})
    assert [lp for _, lp in ours.top] == sorted((lp for _, lp in ours.top), reverse=True)


def test_token_bytes_spell_the_text(tool_tokenizer) -> None:
    text = "héllo 😀 <|im_end|>"
    ids = tool_tokenizer.encode(text, add_special_tokens=False)
    spell = TokenText(tool_tokenizer)
    assert b"".join(spell(t)[1] for t in ids).decode() == text
    assert any("\ufffd" in spell(t)[0] for t in ids)  # half an emoji is not a character


HELLO = [{"role": "user", "content": "Hi"}]
HELLO_CHAT = [Message(role="user", parts=[TextPart(text="Hi")])]


def _chat_request(body: dict) -> object:
    from exo_tp.api.http_io import validate
    from exo_tp.api.openai.schema import ChatCompletionRequest
    from exo_tp.api.openai.unsupported import refuse_unsupported, without_harmless

    refuse_unsupported(body)
    return validate(ChatCompletionRequest, without_harmless(body))


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"audio": {"voice": "alloy"}}, "audio", "text model"),
        ({"modalities": ["text", "audio"]}, "modalities", "text"),
        ({"foo": 1}, "foo", "Unrecognized request argument supplied: foo"),
        ({"n": 17}, "n", "16"),
        ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs", "not a"),
        ({"logit_bias": {"²": 1}}, "logit_bias", "token ids"),
        ({"temperature": "0.5"}, "temperature", "valid number"),
        # a KV cache's width is the nodes' flag, never a request's (docs/api.md)
        ({"kv_bits": 4}, "kv_bits", "exo-tp run --kv-bits"),
        ({"kv_group_size": 32}, "kv_group_size", "exo-tp run --kv-bits"),
        ({"quantized_kv_start": 0}, "quantized_kv_start", "exo-tp run --kv-bits"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is it?"},
                            {"type": "image_url", "image_url": {"url": "data:,"}},
                        ],
                    }
                ]
            },
            "messages[0].content[1]",
            "base64",
        ),
    ],
)
def test_request_fields_the_cluster_cannot_honour(extra: dict, param: str, words: str) -> None:
    with pytest.raises(ApiError) as caught:
        _chat_request({"messages": HELLO, **extra})
    assert (caught.value.status, caught.value.param) == (400, param)
    assert words in caught.value.message


def test_empty_unsupported_fields_mean_nothing() -> None:
    parsed = _chat_request(
        {
            "messages": HELLO,
            "modalities": ["text"],
            "functions": [],
            "audio": None,
            "kv_bits": None,
            "user": "me",
            "parallel_tool_calls": True,
        }
    )
    assert parsed.chat().messages[0].text() == "Hi"  # type: ignore[attr-defined]


CALL = {"city": "Paris"}


def _call(arguments: object, call_id: str | None = None) -> dict:
    """A tool call of f as a template takes it."""
    ids = {} if call_id is None else {"id": call_id}
    return {**ids, "type": "function", "function": {"name": "f", "arguments": arguments}}


@pytest.mark.parametrize(
    ("module", "schema", "body", "template"),
    [
        (  # OpenAI's messages as the client sent them: developer is system, parts joined, a
            # null kept, an unknown field passed on, content left out comes last
            "exo_tp.api.openai.schema",
            "ChatCompletionRequest",
            {
                "messages": [
                    {"role": "developer", "content": "Be brief."},
                    {"role": "user", "content": [{"type": "text", "text": "Hi "}] * 2},
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}],
                        "reasoning_content": "hm",
                    },
                    {"role": "tool", "tool_call_id": "c1", "content": "ok", "name": None},
                ]
            },
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi Hi "},
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}],
                    "reasoning_content": "hm",
                    "content": "",
                },
                {"role": "tool", "content": "ok", "name": None, "tool_call_id": "c1"},
            ],
        ),
        (  # Anthropic's tool results before the user's text, its tool uses as calls
            "exo_tp.api.anthropic.schema",
            "CountTokensRequest",
            {
                "system": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}],
                "messages": [
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "thinking", "thinking": "hm", "signature": "s"},
                            {"type": "tool_use", "id": "t1", "name": "f", "input": CALL},
                        ],
                    },
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "t1", "content": "ok"},
                            {"type": "text", "text": "Next?"},
                        ],
                    },
                ],
            },
            [
                {"role": "system", "content": "Be\nbrief."},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [_call(CALL, "t1")],
                },
                {"role": "tool", "content": "ok", "tool_call_id": "t1"},
                {"role": "user", "content": "Next?"},
            ],
        ),
        (  # Ollama's thinking is not shown again; a tool result names its tool
            "exo_tp.api.ollama.schema",
            "ChatRequest",
            {
                "messages": [
                    {
                        "role": "assistant",
                        "thinking": "hm",
                        "tool_calls": [{"function": {"name": "f", "arguments": CALL}}],
                    },
                    {"role": "tool", "content": "ok", "tool_name": "f"},
                ]
            },
            [
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [_call(CALL)],
                },
                {"role": "tool", "content": "ok", "name": "f"},
            ],
        ),
        (  # Responses' calls join the assistant message before them
            "exo_tp.api.responses.schema",
            "ResponsesRequest",
            {
                "instructions": "Be brief.",
                "input": [
                    {"role": "assistant", "content": [{"type": "output_text", "text": "Let me"}]},
                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c1", "output": "ok"},
                ],
            },
            [
                {"role": "system", "content": "Be brief."},
                {
                    "role": "assistant",
                    "content": "Let me",
                    "tool_calls": [_call("{}", "c1")],
                },
                {"role": "tool", "content": "ok", "name": "f", "tool_call_id": "c1"},
            ],
        ),
    ],
)
def test_each_dialects_conversation_reaches_the_template_as_text_parts(
    module: str, schema: str, body: dict, template: list[dict]
) -> None:
    from exo_tp.api.http_io import validate

    parsed = validate(getattr(importlib.import_module(module), schema), body)
    messages = parsed.chat().messages
    assert all(isinstance(part, TextPart) for m in messages for part in m.parts)
    # key order too: a template may write a whole message out
    assert [list(m.for_template().items()) for m in messages] == [list(m.items()) for m in template]


@pytest.mark.parametrize(
    ("given", "seconds"),
    # Go's time.ParseDuration examples (Ollama's keep_alive), bare numbers as seconds (JSON or
    # a string of one), negative as for ever
    [
        ("300ms", 0.3),
        ("1.5h", 5400.0),
        ("2h45m", 9900.0),
        ("5m", 300.0),
        ("0", 0.0),
        (0, 0.0),
        (30, 30.0),
        ("-1", -1.0),
        ("-1m", -1.0),
        (-5, -1.0),
    ],
)
def test_durations_as_ollama_takes_them(given: float | str, seconds: float) -> None:
    from exo_tp.durations import parse_duration

    assert parse_duration(given) == pytest.approx(seconds)


@pytest.mark.parametrize("given", ["5x", "", "m", "1h 2m", "five minutes", True, float("inf")])
def test_a_bad_duration_says_what_is_accepted(given: object) -> None:
    from exo_tp.durations import parse_duration

    with pytest.raises(ValueError, match="duration"):
        parse_duration(given)  # type: ignore[arg-type]
