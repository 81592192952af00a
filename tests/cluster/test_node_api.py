"""The OpenAI-compatible API of a real 2-node local cluster (`exo-tp run --local-nodes 2`)."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest
from cluster_helpers import LocalCluster, http_json, local_cluster
from helpers import mlx_lm_reference
from node_views import cluster_view, plan_view
from openai import OpenAI

MODEL = "smollm2-135m"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def cluster(default_models: dict[str, Path]) -> Iterator[LocalCluster]:
    # strict names: "unknown model" below is a 404 (by default one model serves any name, as
    # mlx_lm.server does: tests/cluster/test_harden.py)
    with local_cluster(2, weights=[0.6, 0.4], extra=("--strict-model-names",)) as running:
        yield running


@pytest.fixture(scope="module")
def reference(default_models: dict[str, Path]) -> str:
    return mlx_lm_reference(default_models[MODEL], QUESTION, 24).text


def _chat(**overrides: object) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0,
        "max_tokens": 8,
        **overrides,
    }


BAD_CHAT = [
    ("malformed JSON", b'{"model": "smollm2-135m", "messages": [', 400, None),
    ("not an object", [1, 2, 3], 400, None),
    ("missing messages", {"model": MODEL}, 400, "messages"),
    ("empty messages", _chat(messages=[]), 400, "messages"),
    ("unknown model", _chat(model="gpt-5"), 404, "model"),
    ("unknown role", _chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages"),
    ("negative max_tokens", _chat(max_tokens=-5), 400, "max_tokens"),
    ("max_tokens as string", _chat(max_tokens="10"), 400, "max_tokens"),
    ("temperature as word", _chat(temperature="hot"), 400, "temperature"),
    ("temperature too high", _chat(temperature=7), 400, "temperature"),
    ("messages as string", _chat(messages="hi"), 400, "messages"),
    ("content as number", _chat(messages=[{"role": "user", "content": 5}]), 400, "messages"),
    ("stream as string", _chat(stream="yes"), 400, "stream"),
    ("too many stops", _chat(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    ("n > 16", _chat(n=17), 400, "n"),
    (
        "prompt longer than context",
        _chat(messages=[{"role": "user", "content": "hello " * 9000}]),
        400,
        "messages",
    ),
]


@pytest.mark.parametrize("node", [0, 1], ids=["leader", "other-node"])
@pytest.mark.parametrize(
    ("case", "body", "status", "param"), BAD_CHAT, ids=[c[0] for c in BAD_CHAT]
)
def test_bad_chat_input_gets_openai_error(
    cluster: LocalCluster, node: int, case: str, body: object, status: int, param: str | None
) -> None:
    code, reply = http_json(f"{cluster.urls[node]}/v1/chat/completions", body, timeout=60)
    assert code == status, (case, reply)
    assert set(reply) == {"error"} and reply["error"]["message"]
    assert reply["error"]["type"] in ("invalid_request_error", "server_error")
    if param:
        assert (reply["error"]["param"] or "").startswith(param), reply


def test_oversized_body_is_413(cluster: LocalCluster) -> None:
    big = _chat(messages=[{"role": "user", "content": "x" * (25 * 1024 * 1024)}])
    code, reply = http_json(f"{cluster.urls[0]}/v1/chat/completions", big, timeout=60)
    assert code == 413 and "error" in reply


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/v1/nothing-here", 404), ("GET", "/v1/chat/completions", 405)],
)
def test_unknown_routes_answer_json(
    cluster: LocalCluster, method: str, path: str, status: int
) -> None:
    parsed = urlparse(cluster.urls[1])
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=10)
    conn.request(method, path)
    response = conn.getresponse()
    assert response.status == status
    assert "error" in json.loads(response.read())


def test_bad_completions_input(cluster: LocalCluster) -> None:
    code, reply = http_json(f"{cluster.urls[1]}/v1/completions", {"model": MODEL}, timeout=30)
    assert code == 400 and reply["error"]["param"] == "prompt"
    for prompts in (["a", ""], ["a"] * 65):  # an empty prompt; more prompts than a request takes
        code, reply = http_json(
            f"{cluster.urls[1]}/v1/completions", {"model": MODEL, "prompt": prompts}, timeout=30
        )
        assert code == 400 and reply["error"]["param"] == "prompt", reply
    body = {"model": MODEL, "prompt": "a", "max_tokens": 0}  # nothing to generate, no echo
    code, reply = http_json(f"{cluster.urls[1]}/v1/completions", body, timeout=30)
    assert code == 400, reply


def test_node_keeps_serving_after_bad_input(cluster: LocalCluster, reference: str) -> None:
    client = OpenAI(base_url=f"{cluster.urls[1]}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=24, messages=[{"role": "user", "content": QUESTION}]
    )
    assert reply.choices[0].message.content == reference
    assert "Paris" in reference


@pytest.mark.parametrize("node", [0, 1], ids=["leader", "other-node"])
def test_openai_client_stream_equals_single_device(
    cluster: LocalCluster, reference: str, node: int
) -> None:
    client = OpenAI(base_url=f"{cluster.urls[node]}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": QUESTION}],
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_completions_stop_and_length(cluster: LocalCluster) -> None:
    client = OpenAI(base_url=f"{cluster.urls[0]}/v1", api_key="unused", max_retries=0)
    full = client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=12
    )
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12
    words = full.choices[0].text.split()
    cut = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        temperature=0,
        max_tokens=12,
        stop=[words[1]],
    )
    assert cut.choices[0].finish_reason == "stop"
    assert full.choices[0].text.startswith(cut.choices[0].text)
    assert words[1] not in cut.choices[0].text


def test_seed_makes_sampling_repeatable(cluster: LocalCluster) -> None:
    client = OpenAI(base_url=f"{cluster.urls[1]}/v1", api_key="unused", max_retries=0)

    def sample(seed: int) -> str:
        reply = client.chat.completions.create(
            model=MODEL,
            temperature=1.0,
            seed=seed,
            max_tokens=16,
            messages=[{"role": "user", "content": "Tell me a story."}],
        )
        return reply.choices[0].message.content or ""

    first, again, other = sample(1), sample(1), sample(2)
    assert first == again
    assert first != other


def test_disconnect_frees_the_slot(cluster: LocalCluster) -> None:
    """A client that leaves mid-stream stops generation on every rank; the next one runs."""
    parsed = urlparse(cluster.urls[0])
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
    conn.request(
        "POST",
        "/v1/chat/completions",
        json.dumps(
            _chat(
                max_tokens=4000,
                stream=True,
                messages=[{"role": "user", "content": "Write a novel."}],
            )
        ),
        {"Content-Type": "application/json"},
    )
    response = conn.getresponse()
    assert response.status == 200
    for _ in range(4):  # a few tokens arrive, then the client goes away
        response.fp.readline()
    conn.close()
    started = time.monotonic()
    code, reply = http_json(f"{cluster.urls[0]}/v1/chat/completions", _chat(), timeout=60)
    assert code == 200, reply
    # 4000 tokens would take minutes: the abandoned stream must have stopped.
    assert time.monotonic() - started < 30


def test_concurrent_requests_queue_and_all_finish(cluster: LocalCluster) -> None:
    results: list[tuple[int, dict]] = []

    def ask(node: int) -> None:
        results.append(http_json(f"{cluster.urls[node]}/v1/chat/completions", _chat(), timeout=120))

    threads = [threading.Thread(target=ask, args=(i % 2,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [code for code, _ in results] == [200] * 4
    texts = {r["choices"][0]["message"]["content"] for _, r in results}
    assert len(texts) == 1  # greedy: the same answer each time


def test_cluster_and_plan_views(cluster: LocalCluster) -> None:
    view = cluster_view(cluster.urls[1])
    assert view.leader == "local-0" and view.state == "ready"
    assert sorted(n.node_id for n in view.nodes) == ["local-0", "local-1"]
    plan = plan_view(cluster.urls[1])
    assert plan.nodes == ("local-0", "local-1") and plan.plan is not None
    assert plan.plan.weights == pytest.approx([0.6, 0.4])
    heads = [r.heads.q_heads for r in plan.plan.ranks]
    assert heads[0].stop - heads[0].start == 6 and heads[1].stop - heads[1].start == 3


def test_library_client_reads_the_cluster_as_its_routes_do(cluster: LocalCluster) -> None:
    from exo_tp import Client
    from exo_tp.errors import ExoTpError

    client = Client(cluster.urls[1])
    seen, read = client.cluster(), cluster_view(cluster.urls[1])
    assert (seen.leader, seen.state) == (read.leader, read.state) == ("local-0", "ready")
    assert sorted(n.node_id for n in seen.nodes) == sorted(n.node_id for n in read.nodes)
    seen_plan, read_plan = client.plan(), plan_view(cluster.urls[1])  # (live figures move)
    assert (seen_plan.nodes, seen_plan.plan) == (read_plan.nodes, read_plan.plan)
    assert client.health().node_id == "local-1"
    listed = http_json(cluster.urls[1] + "/v1/models")[1]["data"]
    assert [m.body() for m in client.models()] == listed
    answer = client.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=4, temperature=0
    )
    assert answer.choices[0].message.content
    with pytest.raises(ExoTpError, match=r"HTTP 4\d\d: "):
        client.load_model("no-such-model-anywhere")
    with pytest.raises(ExoTpError, match="cannot reach"):
        Client("http://127.0.0.1:9", timeout=2).cluster()
