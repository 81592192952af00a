"""What an operator sees (issue #45), on a real 3-node cluster: every refused request is one
log line that says why; a client leaving a stream is one line, no traceback; and the API
defects a hostile-client probe found, checked with the official SDKs."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
from cluster_helpers import LocalCluster, local_cluster, roles, wait_for_log

MODEL = "smollm2-135m"
AGENT = "operator-probe/1.0"
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with local_cluster(3, weights=[1, 1, 1]) as c:
        yield c


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def _log_size(cluster: LocalCluster) -> int:
    return cluster.log.stat().st_size


def test_a_refused_request_is_one_log_line_that_says_why(cluster: LocalCluster) -> None:
    """Sent to a non-leader, validated by the leader: the leader logs it once, naming the
    client that sent it (not the member that passed it on), its user agent and the field."""
    _, other, _ = roles(cluster)
    start = _log_size(cluster)
    reply = httpx.post(
        cluster.urls[other] + "/v1/chat/completions",
        json={"model": MODEL, "messages": CAPITAL, "max_tokens": -3},
        headers={"User-Agent": AGENT},
        timeout=60,
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "max_tokens"
    missing = httpx.post(
        cluster.urls[other] + "/v1/no/such/route", json={}, headers={"User-Agent": AGENT}
    )
    assert missing.status_code == 404

    def refusals(text: str) -> list[str]:
        return [line for line in text.splitlines() if "refused" in line and AGENT in line]

    text = wait_for_log(cluster.log, start, lambda t: len(refusals(t)) >= 2)
    lines = refusals(text)
    assert len(lines) == 2, lines  # each refusal once, on the node that answered it
    bad, unknown = sorted(lines, key=lambda line: "no such route" in line)
    assert "POST /v1/chat/completions with 400" in bad and "field max_tokens" in bad, bad
    assert "client 127.0.0.1;" in bad, bad
    assert "POST (no such route) with 404" in unknown and "/v1/no/such/route" in unknown


def test_a_client_leaving_a_stream_through_a_non_leader_is_one_line_and_no_traceback(
    cluster: LocalCluster,
) -> None:
    _, other, _ = roles(cluster)
    start = _log_size(cluster)
    leaves = 3
    for _ in range(leaves):
        with httpx.stream(
            "POST",
            cluster.urls[other] + "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "Tell a long story."}],
                "max_tokens": 2000,
                "temperature": 0,
                "stream": True,
            },
            timeout=120,
        ) as stream:
            next(stream.iter_lines())  # the first event: the answer is under way; then leave

    def left(text: str) -> int:
        return sum(
            "left /v1/chat/completions before its answer ended" in x for x in text.split("\n")
        )

    text = wait_for_log(cluster.log, start, lambda t: left(t) >= leaves)
    assert "Traceback" not in text and "internal error" not in text, text[-3000:]
    # the cluster is unhurt: a request after them is answered
    reply = _openai(cluster.urls[other]).chat.completions.create(
        model=MODEL, messages=CAPITAL, max_tokens=4, temperature=0
    )
    assert reply.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_leave_out_the_end_of_turn_token(cluster: LocalCluster, stream: bool) -> None:
    """The entries' tokens join to the content, as OpenAI's do (the end-of-turn token that
    ended the answer is no text, so it has no entry)."""
    client = _openai(cluster.urls[1])
    common = {"model": MODEL, "messages": CAPITAL, "max_tokens": 60, "temperature": 0}
    if stream:
        chunks = list(client.chat.completions.create(**common, logprobs=True, stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        entries = [
            e
            for c in chunks
            if c.choices and c.choices[0].logprobs
            for e in c.choices[0].logprobs.content or []
        ]
        reasons = [
            c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
        ]
        assert reasons == ["stop"]
    else:
        reply = client.chat.completions.create(**common, logprobs=True)
        assert reply.choices[0].finish_reason == "stop"  # it ended on its end-of-turn token
        content = reply.choices[0].message.content or ""
        entries = reply.choices[0].logprobs.content or []
    assert content and "".join(e.token for e in entries) == content
    assert not any("<|im_end|>" in e.token for e in entries)


def test_other_modalities_and_empty_content_get_the_documented_errors(
    cluster: LocalCluster,
) -> None:
    client = _openai(cluster.urls[2])
    with pytest.raises(openai.NotFoundError) as missing:
        client.images.generate(model=MODEL, prompt="a cat")
    assert "image generation is not served" in str(missing.value)
    with pytest.raises(openai.BadRequestError) as audio:
        client.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=4, audio={})  # type: ignore[typeddict-item]
    assert audio.value.body["param"] == "audio"  # type: ignore[index]
    claude = anthropic.Anthropic(base_url=cluster.urls[2], api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as empty:
        claude.messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": ""}]
        )
    assert "non-empty content" in str(empty.value)
    # an empty final assistant message is a prefill of the answer: allowed, as Anthropic does
    answer = claude.messages.create(
        model=MODEL,
        max_tokens=4,
        messages=[*CAPITAL, {"role": "assistant", "content": ""}],
    )
    assert answer.content
