"""Structured outputs by constrained decoding, and n choices, on a real 3-rank uneven cluster
(weights 5,3,2 in two pipeline stages: rank 0 the first layers, ranks 1,2 a tensor-parallel
last stage whose first rank, the conductor, masks and samples, and whose other rank follows
its tokens): 200 random schemas through OpenAI's response_format, the Responses API's
text.format and Ollama's format, every answer parsed and validated by the `jsonschema`
package, batched next to unconstrained streams whose text must equal single-device mlx-lm's;
forced tool calls whose arguments validate against the tool's parameters; the 400 that names
a schema llguidance cannot compile; n choices through the official openai SDK, whole and
streamed, each greedy choice single-device mlx-lm's text and seeded choices different."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest
import test_api_clients
from cluster_helpers import LocalCluster, http_json, local_cluster
from helpers import mlx_lm_reference
from openai import APIError, BadRequestError, OpenAI
from random_schemas import max_bytes, random_schema
from tool_model import write_tool_model

from exo_tp.api.core.errors import ApiError
from exo_tp.api.core.structured import tool_call

SCHEMAS = 200
PROMPT = [{"role": "user", "content": "Reply with a JSON object."}]  # one prompt: cached
FREE_PROMPTS = ["What is the capital of France?", "Name three primary colors."]
FREE_TOKENS = 12
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)a"}}}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def model_dir(tiny_smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's tokenizer with a Qwen-style tool template on tiny random weights: constrained
    decoding and exactness hold whatever the weights (the 200 schemas took 122 s of SmolLM2)."""
    return write_tool_model(tmp_path_factory.mktemp("tool-model") / "tiny-tools", tiny_smollm2)


@pytest.fixture(scope="module")
def cluster(model_dir: Path) -> Iterator[LocalCluster]:
    extra = ("--stages", "1,2", "--max-concurrency", "32")
    with local_cluster(3, weights=[5, 3, 2], model=str(model_dir), extra=extra) as running:
        yield running


def _client(cluster: LocalCluster) -> OpenAI:
    return OpenAI(base_url=f"{cluster.urls[0]}/v1", api_key="unused", max_retries=0, timeout=600)


def _structured(cluster: LocalCluster, index: int, schema: dict[str, Any]) -> str:
    """One schema's answer, through the dialect ``index`` picks; greedy or sampled."""
    budget = max_bytes(schema) + 1  # every token is at least a byte: the JSON always ends
    sampling: dict[str, Any] = {"temperature": 0.0} if index % 2 else {"temperature": 0.7}
    dialect = index % 3
    if dialect == 0:
        reply = _client(cluster).chat.completions.create(
            model="default_model",
            messages=PROMPT,  # type: ignore[arg-type]
            max_tokens=budget,
            seed=index,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"s{index}", "schema": schema, "strict": True},
            },
            **sampling,
        )
        assert reply.choices[0].finish_reason == "stop"
        return reply.choices[0].message.content or ""
    if dialect == 1:
        response = _client(cluster).responses.create(
            model="default_model",
            input=PROMPT[0]["content"],
            max_output_tokens=budget,
            text={"format": {"type": "json_schema", "name": f"s{index}", "schema": schema}},
            **sampling,
        )
        assert response.status == "completed"
        return response.output_text
    status, body = http_json(
        f"{cluster.urls[0]}/api/chat",
        {
            "messages": PROMPT,
            "stream": False,
            "format": schema,
            "options": {"num_predict": budget, "seed": index, **sampling},
        },
        timeout=600,
    )
    assert status == 200, body
    assert body["done_reason"] == "stop"
    return body["message"]["content"]


def _free(cluster: LocalCluster, prompt: str) -> str:
    reply = _client(cluster).chat.completions.create(
        model="default_model",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=FREE_TOKENS,
        temperature=0,
    )
    return reply.choices[0].message.content or ""


def test_random_schemas_parse_and_validate_batched_next_to_free_streams(
    cluster: LocalCluster, model_dir: Path
) -> None:
    rng = random.Random(40)
    schemas = [random_schema(rng) for _ in range(SCHEMAS)]
    references = {p: mlx_lm_reference(model_dir, p, FREE_TOKENS).text for p in FREE_PROMPTS}
    with ThreadPoolExecutor(32) as pool:
        # the unconstrained streams join first, then stay in the batch with constrained ones
        free = {p: pool.submit(_free, cluster, p) for p in FREE_PROMPTS}
        answers = list(pool.map(_structured, [cluster] * SCHEMAS, range(SCHEMAS), schemas))
        assert {p: f.result() for p, f in free.items()} == references
    for schema, answer in zip(schemas, answers, strict=True):
        jsonschema.validate(json.loads(answer), schema)  # raises, naming the schema's rule


def test_json_object_mode_answers_an_object(cluster: LocalCluster) -> None:
    reply = _client(cluster).chat.completions.create(
        model="default_model",
        messages=PROMPT,  # type: ignore[arg-type]
        max_tokens=32,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)
    else:  # an object may be longer than 32 tokens; what there is starts as one
        assert (reply.choices[0].message.content or "").startswith("{")
    status, body = http_json(
        f"{cluster.urls[0]}/api/generate",
        {
            "prompt": "A JSON object:",
            "format": "json",
            "stream": False,
            "options": {"num_predict": 32},
        },
        timeout=600,
    )
    assert status == 200 and body["response"].startswith("{"), body


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_forced_tool_calls_have_arguments_that_validate(cluster: LocalCluster, choice: Any) -> None:
    reply = _client(cluster).chat.completions.create(
        model="default_model",
        messages=[{"role": "user", "content": "Tell me a story."}],
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice=choice,
        max_tokens=60,
        temperature=0,
    )
    (call,) = reply.choices[0].message.tool_calls or []
    assert reply.choices[0].finish_reason == "tool_calls"
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_anthropic_tool_choice_any_gives_a_call_that_validates(cluster: LocalCluster) -> None:
    tool = TIME["function"]
    message = test_api_clients._anthropic(cluster).messages.create(
        model="default_model",
        max_tokens=60,
        messages=[{"role": "user", "content": "Tell me a story."}],
        tools=[{"name": tool["name"], "input_schema": tool["parameters"]}],  # type: ignore[list-item]
        tool_choice={"type": "any"},
    )
    (call,) = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and call.name == "get_time"
    jsonschema.validate(call.input, tool["parameters"])


def test_a_schema_that_cannot_compile_is_a_400_naming_it(cluster: LocalCluster) -> None:
    client = _client(cluster)
    with pytest.raises(BadRequestError) as caught:
        client.chat.completions.create(
            model="default_model",
            messages=PROMPT,  # type: ignore[arg-type]
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": BAD_SCHEMA},
            },
        )
    assert caught.value.body["param"] == "response_format.json_schema.schema"  # type: ignore[index]
    assert "look-around" in caught.value.body["message"]  # type: ignore[index]
    with pytest.raises(BadRequestError) as caught:
        client.responses.create(
            model="default_model",
            input="hi",
            text={"format": {"type": "json_schema", "name": "x", "schema": BAD_SCHEMA}},
        )
    assert caught.value.body["param"] == "text.format.schema"  # type: ignore[index]
    status, body = http_json(
        f"{cluster.urls[0]}/api/chat",
        {"messages": PROMPT, "format": {"type": "nonsense"}, "stream": False},
    )
    assert status == 400 and "format" in json.dumps(body), body
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}
    with pytest.raises(BadRequestError) as caught:
        client.chat.completions.create(
            model="default_model",
            messages=PROMPT,  # type: ignore[arg-type]
            tools=[bad_tool],  # type: ignore[list-item]
            tool_choice="required",
        )
    assert caught.value.body["param"] == "tools"  # type: ignore[index]


def test_forced_calls_in_an_unknown_call_syntax_are_refused() -> None:
    import mlx_lm.tool_parsers.pythonic as pythonic

    tokenizer = SimpleNamespace(tool_parser=pythonic.parse_tool_call, tool_call_end="")
    with pytest.raises(ApiError) as caught:
        tool_call(tokenizer, [WEATHER])  # type: ignore[arg-type]
    assert caught.value.status == 400 and caught.value.param == "tool_choice"


def test_n_greedy_choices_each_equal_single_device(cluster: LocalCluster, model_dir: Path) -> None:
    reference = mlx_lm_reference(model_dir, FREE_PROMPTS[1], FREE_TOKENS).text
    client = _client(cluster)
    reply = client.chat.completions.create(
        model="default_model",
        messages=[{"role": "user", "content": FREE_PROMPTS[1]}],
        max_tokens=FREE_TOKENS,
        temperature=0,
        n=3,
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == [reference] * 3
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 3 * FREE_TOKENS  # the prompt counted once
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 3 * FREE_TOKENS
    completion = client.completions.create(
        model="default_model", prompt="The capital of France is", max_tokens=6, temperature=0, n=2
    )
    assert [c.index for c in completion.choices] == [0, 1]
    assert completion.choices[0].text == completion.choices[1].text


def test_n_seeded_choices_differ_and_stream_as_they_answer(cluster: LocalCluster) -> None:
    client = _client(cluster)
    fields: dict[str, Any] = {
        "model": "default_model",
        "messages": [{"role": "user", "content": "Tell me a story about a dragon."}],
        "max_tokens": FREE_TOKENS,
        "temperature": 1.0,
        "seed": 7,
        "n": 2,
    }
    whole = client.chat.completions.create(**fields)
    texts = [c.message.content for c in whole.choices]
    assert texts[0] != texts[1]  # choice i samples with seed + i
    streamed = ["", ""]
    usage = None
    for chunk in client.chat.completions.create(
        **fields, stream=True, stream_options={"include_usage": True}
    ):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
        usage = chunk.usage or usage
    assert streamed == texts  # the same seeds: the same choices
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    shaped = client.chat.completions.create(
        **{**fields, "max_tokens": 12},
        response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}},
    )
    for choice in shaped.choices:
        jsonschema.validate(json.loads(choice.message.content or ""), schema)


# Valid but hostile schemas (issue #60): each a 400 before any token, or an answer that parses
# and validates; never a 200 with text that is no value. The property names mark the schema's
# text, which the node's log must not hold.
WIDE = {"type": "object", "properties": {f"hostile_{i}": {"type": "string"} for i in range(2000)}}
HOSTILE: dict[str, dict[str, Any]] = {
    "ref_loop": {
        "$defs": {
            "hostile_a": {"$ref": "#/$defs/hostile_b"},
            "hostile_b": {"$ref": "#/$defs/hostile_a"},
        },
        "$ref": "#/$defs/hostile_a",
    },
    "required_self": {
        "type": "object",
        "properties": {"hostile_self": {"$ref": "#"}},
        "required": ["hostile_self"],
    },
    "wide": WIDE,
}
# Past the compile-time probe (26 first keys to pick from), every path then meets the wide
# object, which llguidance cannot decode: the grammar fails while decoding.
LATE = {
    "$defs": {"wide": WIDE},
    "anyOf": [
        {
            "type": "object",
            "properties": {f"{key}_hostile": {"$ref": "#/$defs/wide"}},
            "required": [f"{key}_hostile"],
            "additionalProperties": False,
        }
        for key in "abcdefghijklmnopqrstuvwxyz"
    ],
}
CHAT_PARAM = "response_format.json_schema.schema"


@pytest.fixture(scope="module")
def bias(model_dir: Path) -> dict[str, int]:
    """OpenAI's logit_bias that keeps the tiny model from its favourite first token, "{}"
    (valid under any object schema): the answer must then go inside the object."""
    from tokenizers import Tokenizer

    empty = Tokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id("{}")
    return {str(empty): -100}


def _hostile(
    cluster: LocalCluster, how: str, schema: dict[str, Any], bias: dict[str, int]
) -> tuple[int, Any]:
    """(400, the error) or (200, the answer's text), through OpenAI's chat (streamed or not)
    or Ollama's; a streamed error after the first token is (200, the error event's error)."""
    if how == "ollama":
        status, body = http_json(
            f"{cluster.urls[0]}/api/chat",
            {"messages": PROMPT, "stream": False, "format": schema, "options": {"num_predict": 40}},
            timeout=600,
        )
        return status, body if status != 200 else body["message"]["content"]
    fields: dict[str, Any] = {
        "model": "default_model",
        "messages": PROMPT,
        "max_tokens": 40,
        "temperature": 0,
        "logit_bias": bias,
        "response_format": {"type": "json_schema", "json_schema": {"name": "h", "schema": schema}},
    }
    try:
        if how == "chat":
            reply = _client(cluster).chat.completions.create(**fields)
            assert reply.choices[0].finish_reason == "stop", reply
            return 200, reply.choices[0].message.content or ""
        text = ""
        for chunk in _client(cluster).chat.completions.create(**fields, stream=True):
            text += "".join(c.delta.content or "" for c in chunk.choices)
        return 200, text
    except BadRequestError as refused:
        return 400, refused.body
    except APIError as failed:  # an error event in the open stream
        return 200, {"error": failed.body}


@pytest.mark.parametrize("how", ["chat", "chat_stream", "ollama"])
@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_schema_is_refused_or_answers_a_valid_value(
    cluster: LocalCluster, bias: dict[str, int], name: str, how: str
) -> None:
    schema = HOSTILE[name]
    status, answer = _hostile(cluster, how, schema, bias)
    if status == 400:  # before any token, naming the field
        assert answer["param"] == CHAT_PARAM if how != "ollama" else "format" in answer["error"]
        return
    assert status == 200 and isinstance(answer, str), answer
    jsonschema.validate(json.loads(answer), schema)


@pytest.mark.parametrize("how", ["chat", "chat_stream", "ollama"])
def test_a_grammar_that_fails_while_decoding_is_an_error_the_client_sees(
    cluster: LocalCluster, bias: dict[str, int], how: str
) -> None:
    status, answer = _hostile(cluster, how, LATE, bias)
    assert not isinstance(answer, str), (status, answer)  # never a "stop" after no value
    assert "grammar failed" in json.dumps(answer), answer
    # the schema's fault, not the server's: no 5xx (streamed: an error event in the 200)
    assert status == 400 or (how == "chat_stream" and status == 200), (status, answer)


@pytest.mark.parametrize("schema", [HOSTILE["required_self"], LATE])
def test_a_hostile_schema_leaves_one_short_line_in_the_log(
    cluster: LocalCluster, bias: dict[str, int], schema: dict[str, Any]
) -> None:
    start = cluster.log.stat().st_size
    status, _ = _hostile(cluster, "chat", schema, bias)
    time.sleep(1)  # the conductor's process writes its own lines
    lines = cluster.log.read_bytes()[start:].decode(errors="replace").splitlines()
    assert status == 400 and len(lines) <= 2, lines
    assert not any("hostile_" in line or "Traceback" in line for line in lines), lines
