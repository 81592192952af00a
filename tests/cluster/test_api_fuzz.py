"""No request can hurt the cluster: hand-written nasties and hypothesis over the request schemas
against a real 2-node cluster. Every answer is below 500, the cluster never changes epoch (no
worker died, nothing re-planned), and a normal request is served after each one.

The cluster's default ``--max-tokens 2`` keeps requests that are valid (and so generate) short.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
from cluster_helpers import LocalCluster, http_json, local_cluster
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from node_views import cluster_view

MODEL = "smollm2-135m"
VOCAB = 49152
HELLO = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def cluster(default_models: dict[str, Path]) -> Iterator[LocalCluster]:
    with local_cluster(2, weights=[0.5, 0.5], extra=("--max-tokens", "2")) as running:
        yield running


@pytest.fixture(scope="module")
def epoch(cluster: LocalCluster) -> int:
    return cluster_view(cluster.urls[0]).epoch


def _post(url: str, path: str, body: bytes) -> tuple[int, bytes]:
    """The raw exchange (a stream is read to its end)."""
    parsed = urlparse(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=120)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _still_serving(cluster: LocalCluster, epoch: int, what: str) -> None:
    """The cheapest normal request (one prompt token, one generated), through the other
    node; and the cluster still on its first epoch."""
    code, reply = http_json(
        f"{cluster.urls[1]}/v1/completions",
        {"prompt": [504], "max_tokens": 1, "temperature": 0},
        timeout=120,
    )
    assert code == 200 and reply["usage"]["completion_tokens"] == 1, (what, reply)
    view = cluster_view(cluster.urls[0])
    assert (view.epoch, view.state) == (epoch, "ready"), (what, view)


def _check(cluster: LocalCluster, epoch: int, path: str, body: Any, node: int = 0) -> int:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    code, reply = _post(cluster.urls[node], path, raw)
    what = f"{path} {raw[:300]!r} -> {code} {reply[:300]!r}"
    assert code < 500, what
    if code >= 400:
        error = json.loads(reply)
        assert error.get("error", {}).get("message"), what
    _still_serving(cluster, epoch, what)
    return code


DEEP = b'{"messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
NASTIES: list[tuple[str, Any, int]] = [
    # the issue's: an empty prompt reached rank 0 and failed the whole epoch
    ("/v1/completions", {"prompt": ""}, 400),
    ("/v1/completions", {"prompt": [""]}, 400),
    ("/v1/completions", {"prompt": []}, 400),
    ("/v1/completions", {"prompt": [[]]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, 400),
    ("/v1/completions", {"prompt": "a\udfffb"}, 400),
    ("/v1/chat/completions", DEEP, 400),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        400,
    ),
    ("/v1/chat/completions", b'{"messages": [], "seed": 1e999}', 400),
    ("/v1/chat/completions", b"\xef\xbb\xbf{}", 400),
    ("/v1/chat/completions", b"\xff\xfe\x00", 400),
    # token ids and numbers a worker would choke on
    ("/v1/completions", {"prompt": [VOCAB]}, 400),
    ("/v1/completions", {"prompt": [-1]}, 400),
    ("/v1/completions", {"prompt": [2**63]}, 400),
    ("/v1/completions", {"prompt": [[1, 2], [3]]}, 200),  # two prompts: a choice each
    ("/v1/completions", {"prompt": [[1, 2], []]}, 400),
    ("/v1/completions", {"prompt": [1.5]}, 400),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"99999999": 1}}, 400),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"-1": 1}}, 400),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"x": 1}}, 400),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"5": 1e30}}, 400),
    ("/v1/chat/completions", {"messages": HELLO, "seed": 2**70}, 400),
    ("/v1/chat/completions", {"messages": HELLO, "seed": -1}, 200),
    ("/v1/chat/completions", {"messages": HELLO, "top_k": 10**30}, 200),
    ("/v1/chat/completions", {"messages": HELLO, "top_k": VOCAB, "temperature": 1}, 200),
    ("/v1/chat/completions", {"messages": HELLO, "temperature": 1e-320}, 200),
    ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 10**40}, 200),  # a cap
    ("/v1/chat/completions", {"messages": HELLO, "repetition_context_size": 2**40}, 400),
    ("/v1/chat/completions", {"messages": HELLO, "repetition_penalty": 1e-300}, 400),
    ("/v1/chat/completions", {"messages": HELLO, "repetition_penalty": 0}, 200),
    ("/v1/chat/completions", {"messages": HELLO, "presence_penalty": -1e30}, 400),
    ("/v1/chat/completions", {"messages": HELLO, "xtc_threshold": 0.9}, 400),
    (
        "/v1/chat/completions",
        {"messages": HELLO, "xtc_probability": 1, "temperature": 1, "xtc_threshold": 0.5},
        200,
    ),
    ("/v1/chat/completions", {"messages": HELLO, "top_logprobs": 21}, 400),
    ("/v1/chat/completions", {"messages": HELLO, "top_logprobs": 20}, 200),
    ("/v1/chat/completions", {"messages": HELLO, "stop": ["x" * 5000]}, 400),
    ("/v1/chat/completions", {"messages": HELLO, "stop": "", "stream": True}, 200),
    # what the chat template could choke on
    ("/v1/chat/completions", {"messages": HELLO, "chat_template_kwargs": {"tokenize": False}}, 400),
    ("/v1/chat/completions", {"messages": HELLO, "chat_template_kwargs": {"messages": 1}}, 400),
    (
        "/v1/chat/completions",
        {
            "messages": HELLO,
            "chat_template_kwargs": {
                "chat_template": "{% for i in range(99999) %}{% for j in range(99999) %}"
                "x{% endfor %}{% endfor %}"
            },
        },
        400,
    ),
    ("/v1/chat/completions", {"messages": HELLO, "chat_template_kwargs": {"documents": 5}}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None}]}, 200),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}]}, 200),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "5"}]}, 200),
    (
        "/v1/chat/completions",
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}
                    ],
                }
            ]
        },
        400,
    ),
    (
        "/v1/chat/completions",
        {"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
    ),  # no tool support: see below
    (
        "/v1/messages",
        {
            "max_tokens": 1,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image", "source": {"type": "base64", "data": "AAAA"}}],
                }
            ],
        },
        400,
    ),
    ("/v1/messages", {"max_tokens": 0, "messages": HELLO}, 400),
    ("/v1/messages", {"max_tokens": 1, "messages": [{"role": "user", "content": "\ud800"}]}, 400),
    (
        "/v1/messages",
        {
            "max_tokens": 1,
            "messages": HELLO,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
        },
        200,  # accepted on every model: one that cannot think simply answers
    ),
    ("/v1/messages", {"max_tokens": 1, "messages": HELLO, "stream": True}, 200),
]


def test_hand_written_nasties(cluster: LocalCluster, epoch: int) -> None:
    for i, (path, body, status) in enumerate(NASTIES):
        code = _check(cluster, epoch, path, body, node=i % 2)
        assert code == status, (path, body if isinstance(body, dict) else body[:80], code)


def test_tools_on_a_model_without_tool_support_are_a_clear_400(cluster: LocalCluster) -> None:
    code, reply = http_json(
        f"{cluster.urls[0]}/v1/chat/completions",
        {"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f"}}]},
    )
    assert code == 400 and reply["error"]["param"] == "tools"
    assert "does not support tools" in reply["error"]["message"]


# ---- hypothesis over the schemas ----------------------------------------------------------

anything = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.just("\ud800"),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
text = st.text(max_size=30) | st.just("") | st.just("a\ud800")


def maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return strategy | anything


part = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "refusal", "x"]), "text": text}
)
message = st.fixed_dictionaries(
    {"role": maybe(st.sampled_from(["system", "developer", "user", "assistant", "tool"]))},
    optional={
        "content": maybe(text | st.lists(part, max_size=2) | st.none()),
        "name": maybe(text),
        "tool_call_id": maybe(text),
    },
)
token = st.integers(-2, VOCAB + 2)
sampling = {
    "temperature": maybe(st.floats(0, 2)),
    "top_p": maybe(st.floats(0, 1)),
    "top_k": maybe(st.integers(0, VOCAB + 10)),
    "min_p": maybe(st.floats(0, 1)),
    "seed": maybe(st.integers(-(2**64), 2**65)),
    "repetition_penalty": maybe(st.floats(0, 3)),
    "repetition_context_size": maybe(st.integers(-1, 2**33)),
    "presence_penalty": maybe(st.floats(-3, 3)),
    "frequency_penalty": maybe(st.floats(-3, 3)),
    "xtc_probability": maybe(st.floats(0, 1)),
    "xtc_threshold": maybe(st.floats(0, 1)),
    "logit_bias": maybe(
        st.dictionaries(st.integers(-2, VOCAB + 2).map(str), st.floats(-150, 150), max_size=3)
    ),
    # small enough to generate quickly when valid (one far past the context is a cap now, and
    # would generate up to the context: a hand-written nasty sends one, greedy)
    "max_tokens": maybe(st.integers(-1, 3)),
    "stop": maybe(text | st.lists(text, max_size=5)),
    "stream": maybe(st.booleans()),
    "n": maybe(st.integers(0, 3)),
    "model": maybe(st.sampled_from([MODEL, "default_model", "gpt-4"])),
}
chat = st.fixed_dictionaries(
    {"messages": maybe(st.lists(message, max_size=3))},
    optional={
        **sampling,
        "logprobs": maybe(st.booleans()),
        "top_logprobs": maybe(st.integers(-1, 25)),
        "tools": anything,
        "tool_choice": maybe(st.sampled_from(["none", "auto", "required"])),
        "chat_template_kwargs": anything,
        "response_format": anything,
        "stream_options": maybe(st.fixed_dictionaries({"include_usage": st.booleans()})),
        "unknown_field": anything,
    },
)
completion = st.fixed_dictionaries(
    {
        "prompt": maybe(
            text | st.lists(token, max_size=4) | st.lists(st.lists(token, max_size=3), max_size=2)
        )
    },
    optional={
        **sampling,
        "logprobs": maybe(st.integers(-1, 25) | st.booleans()),
        "echo": maybe(st.booleans()),
        "suffix": maybe(text),
    },
)
messages_api = st.fixed_dictionaries(
    {"max_tokens": maybe(st.integers(-1, 3)), "messages": maybe(st.lists(message, max_size=2))},
    optional={
        "system": maybe(text),
        "temperature": maybe(st.floats(0, 1)),
        "stop_sequences": maybe(st.lists(text, max_size=2)),
        "stream": st.booleans(),
        "tool_choice": anything,
        "tools": anything,
    },
)
requests = (
    st.tuples(st.just("/v1/chat/completions"), chat)
    | st.tuples(st.just("/v1/completions"), completion)
    | st.tuples(st.just("/v1/messages"), messages_api)
)


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=requests, node=st.integers(0, 1))
def test_fuzzed_requests_never_hurt_the_cluster(
    cluster: LocalCluster, epoch: int, request: tuple[str, dict[str, Any]], node: int
) -> None:
    path, body = request
    _check(cluster, epoch, path, body, node)
