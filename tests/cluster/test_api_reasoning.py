"""A thinking model's reasoning, split from its answer in every dialect, whole and streamed
(issue #40): OpenAI chat's `reasoning_content` (and mlx-lm's `reasoning`), Anthropic
`thinking` blocks when `thinking.type` is `enabled`, Ollama's `thinking` under `think`, and
Responses `reasoning` items under `reasoning.effort`; with thinking off, only the answer.

The cluster (2 nodes) serves SmolLM2 given thinking markers and a Qwen3-style template
(tests/thinking_model.py) with the server's default `enable_thinking: false`. An earlier turn
shows the model how it answers; it copies it, so with thinking on it writes its reasoning,
closes the block and answers. The reference is single-device mlx-lm's greedy text for the
prompt mlx_lm.server renders, cut at `</think>` by the test itself."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import ollama
import pytest
from api_reference import SingleDevice
from cluster_helpers import LocalCluster, local_cluster
from openai import OpenAI
from thinking_model import write_thinking_model

TOKENS = 40  # the answers end (end of turn) well before
EXAMPLE = "<think>\nThe user greets me.\n</think>\n\nHello!"  # as Qwen3 writes it
CHAT = [
    {"role": "user", "content": "Say hi."},
    {"role": "assistant", "content": EXAMPLE},
    {"role": "user", "content": "Say hi."},
]


@pytest.fixture(scope="module")
def model_dir(default_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_thinking_model(
        tmp_path_factory.mktemp("thinking-model") / "smollm2-thinking",
        default_models["smollm2-135m"],
    )


@pytest.fixture(scope="module")
def cluster(model_dir: Path) -> Iterator[LocalCluster]:
    with local_cluster(2, weights=[0.6, 0.4], model=str(model_dir)) as running:
        yield running


@pytest.fixture(scope="module")
def ref(model_dir: Path) -> SingleDevice:
    return SingleDevice(model_dir, {"enable_thinking": False})


@pytest.fixture(scope="module")
def expected(ref: SingleDevice) -> dict[bool, tuple[str, str]]:
    """(reasoning, answer) with thinking on and off, from single-device mlx-lm."""
    out = {}
    for thinking in (True, False):
        prompt = ref.chat_tokens(CHAT, template_kwargs={"enable_thinking": thinking})
        generated = ref.generate(prompt, TOKENS)
        assert generated.finish_reason == "stop"
        # the prompt opens the block when thinking is on: the text up to </think> is reasoning
        reasoning, _, answer = (
            generated.text.partition("</think>") if thinking else ("", "", generated.text)
        )
        out[thinking] = (reasoning, answer)
    assert out[True][0] and out[True][1] and not out[False][0]  # the test can tell them apart
    return out


@pytest.mark.parametrize("thinking", [True, False])
def test_openai_chat_reasoning_content(
    cluster: LocalCluster, expected: dict[bool, tuple[str, str]], thinking: bool
) -> None:
    client = OpenAI(base_url=f"{cluster.urls[1]}/v1", api_key="unused", max_retries=0)
    request: dict[str, Any] = {
        "model": "default_model",
        "messages": CHAT,
        "max_tokens": TOKENS,
        "extra_body": {"chat_template_kwargs": {"enable_thinking": thinking}},
    }
    reasoning, answer = expected[thinking]
    message = client.chat.completions.create(**request).choices[0].message
    extra = message.model_extra or {}
    assert (extra.get("reasoning_content", ""), message.content) == (reasoning, answer)
    assert extra.get("reasoning", "") == reasoning  # mlx_lm.server's name for it
    streamed = {"reasoning_content": "", "reasoning": "", "content": ""}
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            delta = {**(choice.delta.model_extra or {}), "content": choice.delta.content or ""}
            for key in streamed:
                streamed[key] += delta.get(key) or ""
    assert streamed == {"reasoning_content": reasoning, "reasoning": reasoning, "content": answer}


@pytest.mark.parametrize("thinking", ["enabled", "disabled"])
def test_anthropic_thinking_blocks(
    cluster: LocalCluster, expected: dict[bool, tuple[str, str]], thinking: str
) -> None:
    client = anthropic.Anthropic(base_url=cluster.urls[0], api_key="unused", max_retries=0)
    config: Any = (
        {"type": "enabled", "budget_tokens": 1024}
        if thinking == "enabled"
        else {"type": "disabled"}
    )
    request: dict[str, Any] = {
        "model": "default_model",
        "messages": CHAT,
        "max_tokens": TOKENS,
        "thinking": config,
    }
    reasoning, answer = expected[thinking == "enabled"]
    shown = [("thinking", reasoning)] if reasoning else []
    message = client.messages.create(**request)
    blocks = [(b.type, b.thinking if b.type == "thinking" else b.text) for b in message.content]
    assert blocks == [*shown, ("text", answer)]
    with client.messages.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert kinds == sorted(kinds, key=lambda k: k != "thinking_delta")  # thinking comes first
    streamed = [(b.type, b.thinking if b.type == "thinking" else b.text) for b in final.content]
    assert streamed == [*shown, ("text", answer)]


@pytest.mark.parametrize("think", [True, False])
def test_ollama_thinking(
    cluster: LocalCluster, expected: dict[bool, tuple[str, str]], think: bool
) -> None:
    client = ollama.Client(host=cluster.urls[1])
    model = client.list().models[0].model
    assert model
    reasoning, answer = expected[think]
    options = {"num_predict": TOKENS}
    reply = client.chat(model, CHAT, think=think, options=options)
    assert (reply.message.thinking or "", reply.message.content) == (reasoning, answer)
    thought, said = "", ""
    for part in client.chat(model, CHAT, think=think, options=options, stream=True):
        thought += part.message.thinking or ""
        said += part.message.content or ""
    assert (thought, said) == (reasoning, answer)


def _sse(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        lines = response.read().decode().splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ")]


@pytest.mark.parametrize("effort", ["medium", "none"])
def test_responses_reasoning_items(
    cluster: LocalCluster, expected: dict[bool, tuple[str, str]], effort: str
) -> None:
    client = OpenAI(base_url=f"{cluster.urls[0]}/v1", api_key="unused", max_retries=0)
    reasoning, answer = expected[effort != "none"]
    request: dict[str, Any] = {
        "model": "default_model",
        "input": CHAT,
        "max_output_tokens": TOKENS,
        "reasoning": {"effort": effort, "summary": "auto"},
    }
    reply = client.responses.create(**request)
    kinds = [item.type for item in reply.output]
    assert kinds == (["reasoning", "message"] if reasoning else ["message"])
    if reasoning:
        item = reply.output[0]
        assert item.type == "reasoning" and item.content
        assert "".join(part.text for part in item.content) == reasoning
    assert reply.output_text == answer
    events = _sse(f"{cluster.urls[1]}/v1/responses", {**request, "stream": True})
    deltas = {"response.reasoning_text.delta": "", "response.output_text.delta": ""}
    for event in events:
        if event["type"] in deltas:
            deltas[event["type"]] += event["delta"]
    assert deltas == {
        "response.reasoning_text.delta": reasoning,
        "response.output_text.delta": answer,
    }
    assert events[-1]["type"] == "response.completed"


BUDGET = 4  # thinking tokens: the model's own reasoning takes more


def test_anthropic_thinking_budget_caps_the_thinking(
    cluster: LocalCluster, ref: SingleDevice
) -> None:
    """budget_tokens: after that many tokens of thinking the block is closed for the model
    (its end marker and a blank line, as budget forcing does) and it answers from there;
    the reference generates the same two parts on a single device."""
    prompt = ref.chat_tokens(CHAT, template_kwargs={"enable_thinking": True})
    thought = ref.generate(prompt, BUDGET)
    assert "</think>" not in thought.text  # the budget does cut the thinking
    closing = ref.tokenizer.encode("</think>\n\n", add_special_tokens=False)
    rest = ref.generate([*prompt, *thought.tokens, *closing], TOKENS - BUDGET - len(closing))
    assert rest.finish_reason == "stop"
    client = anthropic.Anthropic(base_url=cluster.urls[1], api_key="unused", max_retries=0)
    request: dict[str, Any] = {
        "model": "default_model",
        "messages": CHAT,
        "max_tokens": TOKENS,
        "thinking": {"type": "enabled", "budget_tokens": BUDGET},
    }
    answer = [("thinking", thought.text), ("text", "\n\n" + rest.text)]
    message = client.messages.create(**request)
    assert [(b.type, b.thinking if b.type == "thinking" else b.text) for b in message.content] == (
        answer
    )
    assert message.usage.output_tokens == BUDGET + len(closing) + len(rest.tokens)
    with client.messages.stream(**request) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.thinking if b.type == "thinking" else b.text) for b in final.content] == (
        answer
    )
