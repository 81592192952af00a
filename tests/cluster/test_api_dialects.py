"""The other dialects on a real 2-node uneven cluster, against their official clients: Ollama's
API through the `ollama` Python client, OpenAI's Responses API through the `openai` SDK's
`client.responses`, and completions whose text continues their prompt. Every answer is compared
with single-device mlx-lm (tests/api_reference.py) and the tokenizer's own decode.

The cluster serves SmolLM2 with a tool-capable chat template (tests/tool_model.py) and
mlx_lm.server's defaults (greedy).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ollama
import pytest
from api_reference import Generated, Sampling, SingleDevice
from cluster_helpers import LocalCluster, http_json, local_cluster
from openai import OpenAI
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from tool_model import write_tool_model

QUESTION = [{"role": "user", "content": "Tell me a story about a dragon."}]
PREFIX = "The capital of France is"
TOKENS = 8
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather of a city",
        "parameters": WEATHER_PARAMETERS,
    },
}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
REPEAT_CALL = [{"role": "user", "content": f"Repeat exactly: {CALL_TEXT}"}]
CALL_TOKENS = 36


@pytest.fixture(scope="module")
def model_dir(default_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tool_model(
        tmp_path_factory.mktemp("tool-model") / "smollm2-tools", default_models["smollm2-135m"]
    )


@pytest.fixture(scope="module")
def cluster(model_dir: Path) -> Iterator[LocalCluster]:
    # strict names: an unknown model is a 404 in each dialect's shape (test_refusals_are_clear)
    with local_cluster(
        2, weights=[0.6, 0.4], model=str(model_dir), extra=("--strict-model-names",)
    ) as running:
        yield running


@pytest.fixture(scope="module")
def ref(model_dir: Path) -> SingleDevice:
    return SingleDevice(model_dir)


@pytest.fixture(scope="module")
def repeated(ref: SingleDevice) -> Generated:
    """SmolLM2 asked to repeat a tool call, as single-device mlx-lm answers (greedy)."""
    return ref.generate(ref.chat_tokens(REPEAT_CALL, [WEATHER]), CALL_TOKENS)


def _openai(cluster: LocalCluster, node: int = 0) -> OpenAI:
    return OpenAI(base_url=f"{cluster.urls[node]}/v1", api_key="unused", max_retries=0, timeout=300)


def _ollama(cluster: LocalCluster, node: int = 0) -> ollama.Client:
    return ollama.Client(host=cluster.urls[node], timeout=300)


def _model(cluster: LocalCluster) -> str:
    return str(http_json(f"{cluster.urls[0]}/v1/models")[1]["data"][0]["id"])


# ---- completions keep their text ----------------------------------------------------------

CONTINUATIONS = [
    (PREFIX, " Paris, a city of light."),
    ("Café", " au lait: naïve ☕ crème\n\n  indented"),
    ("Line one\n", "Line two ends with a space "),
    ("数字", "是 一二三"),
]


@pytest.mark.parametrize("case", range(len(CONTINUATIONS)))
def test_continuation_detokenizer_spells_the_tokenizers_decode(
    default_models: dict[str, Path], case: int
) -> None:
    """Streamed token by token, a continuation's text is what the tokenizer's own decode of
    prompt + continuation adds to the prompt's (mlx-lm's answer detokenizer drops a first
    space: the reason for the continuation one)."""
    from exo_tp.models.tokenizer import load_model_tokenizer
    from exo_tp.runtime.detokenizers import Detokenizers

    tokenizer = load_model_tokenizer(default_models["smollm2-135m"])
    prompt_text, more = CONTINUATIONS[case]
    prompt = tokenizer.encode(prompt_text)
    added = tokenizer.encode(prompt_text + more)[len(prompt) :]
    assert tokenizer.encode(prompt_text + more)[: len(prompt)] == prompt
    expected = tokenizer.decode(prompt + added)[len(tokenizer.decode(prompt)) :]
    detokenizer = Detokenizers(tokenizer).new(continuation=True)
    pieces = []
    for token in added:
        detokenizer.add_token(token)
        pieces.append(detokenizer.last_segment)
    detokenizer.finalize()
    pieces.append(detokenizer.last_segment)
    assert "".join(pieces) == expected


def test_completion_continues_its_prompt(cluster: LocalCluster, ref: SingleDevice) -> None:
    """Prompt + completion is the tokenizer's own decode of prompt + generated ids (a first
    token's leading space included), whole, streamed and echoed; logprobs' tokens and offsets
    spell the returned text."""
    prompt = ref.tokenizer.encode(PREFIX)
    generated = ref.generate(prompt, TOKENS).tokens
    whole_text = ref.tokenizer.decode(prompt + generated)
    assert ref.tokenizer.decode(prompt) == PREFIX
    assert whole_text[len(PREFIX)] == " "  # the case at stake: the answer starts with a space
    client = _openai(cluster, node=1)
    common: dict[str, Any] = {"model": "default_model", "max_tokens": TOKENS, "temperature": 0}
    reply = client.completions.create(prompt=PREFIX, logprobs=1, **common)
    text = reply.choices[0].text
    assert PREFIX + text == whole_text
    logprobs = reply.choices[0].logprobs
    assert "".join(logprobs.tokens) == text
    for token, offset in zip(logprobs.tokens, logprobs.text_offset, strict=True):
        assert text[offset:].startswith(token)
    streamed = client.completions.create(prompt=PREFIX, stream=True, **common)
    assert PREFIX + "".join(c.choices[0].text for c in streamed if c.choices) == whole_text
    echoed = client.completions.create(prompt=PREFIX, echo=True, **common)
    assert echoed.choices[0].text == whole_text
    by_ids = client.completions.create(prompt=prompt, echo=True, **common)
    assert by_ids.choices[0].text == whole_text


# ---- Ollama --------------------------------------------------------------------------------


def test_ollama_model_views(cluster: LocalCluster) -> None:
    client = _ollama(cluster, node=1)
    name = _model(cluster)
    assert client.list().models[0].model == name
    running = _ollama(cluster).ps().models
    assert [m.model for m in running] == [name] and running[0].context_length
    shown = client.show(name + ":latest")
    assert "tools" in (shown.capabilities or []) and shown.template
    code, version = http_json(f"{cluster.urls[1]}/api/version")
    assert code == 200 and version["version"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_ollama_chat_equals_mlx_lm(cluster: LocalCluster, ref: SingleDevice, stream: bool) -> None:
    prompt = ref.chat_tokens(QUESTION)
    expected = ref.generate(prompt, TOKENS)
    client = _ollama(cluster, node=int(stream))
    options = {"num_predict": TOKENS, "temperature": 0}
    if stream:
        parts = list(client.chat(_model(cluster), QUESTION, options=options, stream=True))
        assert all(not p.done for p in parts[:-1]) and parts[-1].done
        text = "".join(p.message.content or "" for p in parts)
        last = parts[-1]
    else:
        last = client.chat(_model(cluster), QUESTION, options=options)
        text = last.message.content or ""
    assert text == expected.text
    assert last.done_reason == "length"
    assert last.eval_count == TOKENS and last.prompt_eval_count == len(prompt)
    assert last.total_duration and last.total_duration >= (last.eval_duration or 0) > 0


OLLAMA_SAMPLING = {
    "seed, top_k": (
        {"temperature": 1.0, "top_k": 3, "seed": 5},
        Sampling(temperature=1.0, top_k=3, seed=5),
    ),
    "top_p, min_p": (
        {"temperature": 1.0, "top_p": 0.5, "min_p": 0.05, "seed": 7},
        Sampling(temperature=1.0, top_p=0.5, min_p=0.05, seed=7),
    ),
    "repeat_penalty": (
        {"temperature": 0, "repeat_penalty": 1.8, "repeat_last_n": 5},
        Sampling(repetition_penalty=1.8, repetition_context_size=5),
    ),
}


@pytest.mark.parametrize("case", list(OLLAMA_SAMPLING))
def test_ollama_options_sample_as_mlx_lm(
    cluster: LocalCluster, ref: SingleDevice, case: str
) -> None:
    options, sampling = OLLAMA_SAMPLING[case]
    expected = ref.generate(ref.chat_tokens(QUESTION), TOKENS, sampling)
    reply = _ollama(cluster).chat(
        _model(cluster), QUESTION, options={**options, "num_predict": TOKENS}
    )
    assert reply.message.content == expected.text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_ollama_generate(cluster: LocalCluster, ref: SingleDevice, stream: bool) -> None:
    """Raw generate continues its prompt (leading space kept); templated generate answers
    like a one-message chat; a stop option ends the text before the stop string."""
    client = _ollama(cluster, node=1)
    prompt = ref.tokenizer.encode(PREFIX)
    generated = ref.generate(prompt, TOKENS).tokens
    options = {"num_predict": TOKENS, "temperature": 0}

    def text(reply: Any) -> str:
        if stream:
            return "".join(part.response or "" for part in reply)
        return str(reply.response)

    raw = client.generate(_model(cluster), PREFIX, raw=True, options=options, stream=stream)
    assert PREFIX + text(raw) == ref.tokenizer.decode(prompt + generated)
    answer = ref.generate(ref.chat_tokens(QUESTION), TOKENS).text
    templated = client.generate(
        _model(cluster), QUESTION[0]["content"], options=options, stream=stream
    )
    assert text(templated) == answer
    stop = answer.split()[2]
    cut = client.generate(
        _model(cluster),
        QUESTION[0]["content"],
        options={**options, "stop": [stop]},
        stream=stream,
    )
    assert text(cut) == answer[: answer.index(stop)]


def test_ollama_tool_round_trip(
    cluster: LocalCluster, ref: SingleDevice, repeated: Generated
) -> None:
    """A tool call comes back as Ollama's tool_calls (arguments an object) as mlx-lm's parser
    reads it; the tool's result sent back answers as mlx-lm answers the same conversation."""
    _, calls = ref.tool_calls(repeated.text, [WEATHER])
    assert calls[:1] == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    client = _ollama(cluster)
    reply = client.chat(
        _model(cluster), REPEAT_CALL, tools=[WEATHER], options={"num_predict": CALL_TOKENS}
    )
    got = [
        {"name": c.function.name, "arguments": dict(c.function.arguments)}
        for c in reply.message.tool_calls or []
    ]
    assert got == calls
    conversation = [
        *REPEAT_CALL,
        {"role": "assistant", "content": "", "tool_calls": [{"function": calls[0]}]},
        {"role": "tool", "content": "Sunny, 25 C", "tool_name": "get_weather"},
    ]
    as_openai = [
        *REPEAT_CALL,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 25 C"},
    ]
    prompt = ref.chat_tokens(as_openai, [WEATHER])
    expected = ref.generate(prompt, TOKENS)
    after = client.chat(
        _model(cluster), conversation, tools=[WEATHER], options={"num_predict": TOKENS}
    )
    assert after.prompt_eval_count == len(prompt)
    assert after.message.content == expected.text


# ---- Responses ------------------------------------------------------------------------------

INSTRUCTIONS = "Be brief."
RESPONSE_WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the weather of a city",
    "parameters": WEATHER_PARAMETERS,
}


def _raw_post(url: str, body: dict[str, Any]) -> bytes:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return bytes(response.read())


def test_responses_plain_and_streamed(cluster: LocalCluster, ref: SingleDevice) -> None:
    messages = [{"role": "system", "content": INSTRUCTIONS}, *QUESTION]
    prompt = ref.chat_tokens(messages)
    expected = ref.generate(prompt, TOKENS)
    request: dict[str, Any] = {
        "model": "default_model",
        "input": QUESTION[0]["content"],
        "instructions": INSTRUCTIONS,
        "max_output_tokens": TOKENS,
        "temperature": 0,
        "top_p": 1.0,
    }
    client = _openai(cluster, node=1)
    reply = client.responses.create(**request)
    assert reply.output_text == expected.text
    assert reply.status == "incomplete" and reply.incomplete_details
    assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage and reply.usage.input_tokens == len(prompt)
    assert reply.usage.output_tokens == TOKENS
    # the raw body is a valid Response, not only what the SDK tolerates
    raw = _raw_post(f"{cluster.urls[0]}/v1/responses", request)
    assert Response.model_validate_json(raw).output_text == expected.text
    events = list(client.responses.create(**request, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == expected.text
    assert events[-1].response.output_text == expected.text  # type: ignore[union-attr]
    stream_raw = _raw_post(f"{cluster.urls[1]}/v1/responses", {**request, "stream": True})
    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    for line in stream_raw.decode().splitlines():
        if line.startswith("data: "):
            adapter.validate_json(line.removeprefix("data: "))


def test_responses_function_tool_round_trip(
    cluster: LocalCluster, ref: SingleDevice, repeated: Generated
) -> None:
    content, calls = ref.tool_calls(repeated.text, [WEATHER])
    client = _openai(cluster)
    first = client.responses.create(
        model="default_model",
        input=REPEAT_CALL[0]["content"],
        tools=[RESPONSE_WEATHER],  # type: ignore[list-item]
        max_output_tokens=CALL_TOKENS,
        temperature=0,
    )
    made = [item for item in first.output if item.type == "function_call"]
    assert [{"name": c.name, "arguments": json.loads(c.arguments)} for c in made] == calls
    assert first.output_text == content
    streamed = list(
        client.responses.create(
            model="default_model",
            input=REPEAT_CALL[0]["content"],
            tools=[RESPONSE_WEATHER],  # type: ignore[list-item]
            max_output_tokens=CALL_TOKENS,
            temperature=0,
            stream=True,
        )
    )
    arguments = [
        json.loads(e.arguments)
        for e in streamed
        if e.type == "response.function_call_arguments.done"
    ]
    assert arguments == [c["arguments"] for c in calls]
    call = made[0]
    conversation: list[Any] = [
        {"role": "user", "content": REPEAT_CALL[0]["content"]},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 25 C"},
    ]
    as_openai = [
        *REPEAT_CALL,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 25 C"},
    ]
    prompt = ref.chat_tokens(as_openai, [WEATHER])
    expected = ref.generate(prompt, TOKENS)
    after = client.responses.create(
        model="default_model",
        input=conversation,
        tools=[RESPONSE_WEATHER],  # type: ignore[list-item]
        max_output_tokens=TOKENS,
        temperature=0,
    )
    assert after.usage and after.usage.input_tokens == len(prompt)
    assert after.output_text == expected.text


# ---- what cannot be honoured -----------------------------------------------------------------

REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("/api/chat", {"messages": QUESTION, "format": "yaml"}, "format"),
    ("/api/chat", {"messages": QUESTION, "options": {"mirostat": 2}}, "mirostat"),
    ("/api/chat", {"messages": QUESTION, "options": {"temprature": 1}}, "temprature"),
    ("/api/chat", {"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, "images"),
    ("/api/generate", {"prompt": "x", "template": "{{ .Prompt }}"}, "template"),
    ("/api/generate", {"prompt": "x", "context": [1, 2]}, "context"),
    ("/api/chat", {"model": "no-such-model", "messages": QUESTION}, "no-such-model"),
    ("/v1/responses", {"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ("/v1/responses", {"input": "x", "store": True}, "store"),
    (
        "/v1/responses",
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input item 0",  # not a data URL nor http(s)
    ),
    ("/v1/responses", {"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
    ("/v1/responses", {"input": "x", "text": {"format": {"type": "xml"}}}, "text"),
    ("/v1/responses", {"input": "x", "temperature": 3}, "temperature"),
]


def test_refusals_are_clear(cluster: LocalCluster) -> None:
    """Each a 400 (404 for an unknown model) in the dialect's own error shape, naming what is
    not supported; the cluster keeps serving."""
    for path, body, named in REFUSED:
        node = len(path) % 2  # leader and follower alike
        code, reply = http_json(f"{cluster.urls[node]}{path}", {"stream": False, **body})
        assert code == (404 if named == "no-such-model" else 400), (path, body, reply)
        error = reply["error"]
        message = error if path.startswith("/api/") else error["message"]  # Ollama: a string
        assert isinstance(message, str) and named in message, (body, reply)
    with pytest.raises(ollama.ResponseError) as refused:  # a schema llguidance cannot compile
        _ollama(cluster).chat(_model(cluster), QUESTION, format={"type": "nonsense"})
    assert refused.value.status_code == 400 and "format" in refused.value.error
