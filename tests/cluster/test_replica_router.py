"""Replicas of one model with a router (issue #59 points 3 and 6) on 2 nodes, ``--replicas 2``:
a group on each node, serving like single-device mlx-lm; a conversation's second turn goes
back to the replica whose prompt cache holds its first turn, though the other is less busy by
then; a replica killed mid-stream fails only its stream, and the next requests are served by
the other while it comes back."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import (
    LocalCluster,
    LongStream,
    http_json,
    local_cluster,
    rank_processes,
    until,
)
from helpers import mlx_lm_reference
from lab_profiles import lab_profile
from openai import OpenAI

from exo_tp.wire.profiles import LinkProfile

PROMPT = "Name a fruit."
TOKENS = 8


@pytest.fixture(scope="module")
def cluster(tiny_smollm2: Path) -> Iterator[LocalCluster]:
    extra = ("--replicas", "2")
    with local_cluster(2, weights=[1, 1], model=str(tiny_smollm2), extra=extra, ready=False) as c:
        until(lambda: _ready_groups(c) == 2, "both replicas ready")
        yield c


def _groups(cluster: LocalCluster) -> list[dict[str, Any]]:
    """/v1/cluster's groups on the leader (none while its API is not up yet)."""
    try:
        return list(http_json(f"{cluster.urls[0]}/v1/cluster")[1].get("groups", []))
    except OSError:
        return []


def _ready_groups(cluster: LocalCluster) -> int:
    return sum(g["state"] == "ready" for g in _groups(cluster))


def _client(cluster: LocalCluster) -> OpenAI:
    return OpenAI(base_url=f"{cluster.urls[1]}/v1", api_key="unused", max_retries=0)


def _ask(client: OpenAI, messages: list[dict[str, str]]) -> tuple[str, Any]:
    reply = client.chat.completions.create(
        model="m",
        messages=messages,
        max_tokens=TOKENS,
        temperature=0,  # type: ignore[arg-type]
    )
    return reply.choices[0].message.content or "", reply.usage


def _busy_node(cluster: LocalCluster) -> str:
    """The node of the replica running a request now."""
    busy = until(
        lambda: [g for g in _groups(cluster) if g["in_flight"]], "a replica running the stream"
    )
    assert len(busy) == 1, busy
    return str(busy[0]["ranks"][0])


def test_two_replicas_on_disjoint_nodes_serve_like_mlx_lm(
    cluster: LocalCluster, tiny_smollm2: Path
) -> None:
    groups = _groups(cluster)
    assert sorted(g["replica"] for g in groups) == [0, 1]
    assert sorted(n for g in groups for n in g["ranks"]) == ["local-0", "local-1"]
    reference = mlx_lm_reference(tiny_smollm2, PROMPT, TOKENS).text
    client = _client(cluster)
    answers: list[str] = []

    def ask() -> None:
        answers.append(_ask(client, [{"role": "user", "content": PROMPT}])[0])

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == [reference] * 4


def test_a_conversation_goes_back_to_the_replica_holding_its_prefix(
    cluster: LocalCluster, tiny_smollm2: Path
) -> None:
    client = _client(cluster)
    stream = LongStream(cluster.urls[0], "m").start()
    _busy_node(cluster)  # the story runs on one replica
    turn = [{"role": "user", "content": "Which river runs through Paris?"}]
    first, first_usage = _ask(client, turn)  # the least loaded replica: the other one
    stream.stop()
    until(lambda: not any(g["in_flight"] for g in _groups(cluster)), "both replicas idle")
    history = [*turn, {"role": "assistant", "content": first}]
    question = {"role": "user", "content": "And through Rome?"}
    second, usage = _ask(client, [*history, question])
    # Both replicas idle: without the prefix, the router's tie goes to the first replica,
    # which ran the long story and holds none of this conversation.
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached >= first_usage.prompt_tokens, (first_usage, usage)
    reference = mlx_lm_reference(tiny_smollm2, "", TOKENS, messages=[*history, question])
    assert second == reference.text


def test_a_killed_replica_fails_only_its_stream_and_the_other_serves(
    cluster: LocalCluster, tiny_smollm2: Path
) -> None:
    reference = mlx_lm_reference(tiny_smollm2, PROMPT, TOKENS).text
    doomed = LongStream(cluster.urls[0], "m").start()
    node = _busy_node(cluster)
    # another conversation (no prefix in common past the template's first 24 tokens): to the
    # other replica, the less loaded
    survivor = LongStream(cluster.urls[0], "m", "Write a long poem about the sea.").start()
    os.kill(rank_processes(cluster.proc.pid)[node].pid, signal.SIGKILL)
    assert doomed.ended(120), "the killed replica's stream did not fail"
    client = _client(cluster)
    for _ in range(3):  # served by the living replica while the other comes back
        assert _ask(client, [{"role": "user", "content": PROMPT}])[0] == reference
    survivor.stop()
    assert not survivor.errors
    until(lambda: _ready_groups(cluster) == 2, "the killed replica back")


@pytest.mark.parametrize(
    ("objective", "layout"),
    [("throughput", [["local-0"], ["local-1"]]), ("latency", [["local-0"]])],
)
def test_replicas_auto_follow_the_planner_for_the_objective(
    tmp_path: Path, tiny_smollm2: Path, objective: str, layout: list[list[str]]
) -> None:
    """Two equal nodes over a slow link (5 ms a collective): for throughput the planner
    prices two replicas above one group (every step of a group pays the link), for latency
    one node alone (the link costs more than the second node saves); --replicas auto does
    what `exo-tp plan --replicas` says, and logs why."""
    slow = LinkProfile(
        a="local-0", b="local-1", up=True, all_sum_latency=5e-3, all_sum_bandwidth=1e8
    )
    paths = []
    for node, links in (("local-0", (slow,)), ("local-1", ())):
        path = tmp_path / f"{node}.json"
        path.write_text(lab_profile(3.0, node_id=node, links=links).model_dump_json())
        paths.append(str(path))
    extra = ("--profiles", ",".join(paths), "--replicas", "auto", "--objective", objective)
    with local_cluster(2, model=str(tiny_smollm2), extra=extra, ready=False) as cluster:

        def placed() -> bool:
            groups = _groups(cluster)
            ready = all(g["state"] == "ready" for g in groups)
            return ready and sorted(g["ranks"] for g in groups) == layout

        until(placed, f"the groups over {layout}")
        assert "replicas auto for" in cluster.log.read_text()
