"""Three nodes in three network namespaces behind a bridge: mDNS discovery, cluster formation,
the official openai client, a stranger with the wrong secret, and a killed worker.

The nodes serve SmolLM2's tokenizer and head groups on tiny random weights (the
``tiny_smollm2`` fixture, a folder every namespace reads): what is under test is discovery,
formation and failure over a bridged network, with answers equal to mlx-lm's. Three ranks on
two cores took ~0.7 s a token of SmolLM2's 30 layers here; SmolLM2's own answers on uneven
ranks are tests/ranks/test_tp_exact.py's and tests/cluster/test_node_api.py's."""

from __future__ import annotations

import os
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_helpers import (
    Host,
    NamespaceLab,
    can_make_namespaces,
    wait_ready,
    worker_pids,
)
from helpers import mlx_lm_reference
from node_views import cluster_view, plan_view
from openai import APIError, OpenAI

pytestmark = pytest.mark.skipif(
    can_make_namespaces() is not None, reason=str(can_make_namespaces())
)

MODEL = "default_model"  # the name in requests: the cluster serves one model, whatever its name
QUESTION = "What is the capital of France?"


class Lab:
    def __init__(self, lab: NamespaceLab, hosts: list[Host], cluster: str, tmp: Path):
        self.lab, self.hosts, self.cluster, self.tmp = lab, hosts, cluster, tmp

    @property
    def urls(self) -> list[str]:
        return [h.url for h in self.hosts]

    def client(self, index: int) -> OpenAI:
        return OpenAI(
            base_url=f"{self.hosts[index].url}/v1", api_key="unused", max_retries=0, timeout=120
        )


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, tiny_smollm2: Path) -> Iterator[Lab]:
    tmp = tmp_path_factory.mktemp("netns")
    lab = NamespaceLab()
    lab.up()
    try:
        hosts = [lab.add_host() for _ in range(3)]
        cluster, secret = f"lab-{lab.tag}", secrets.token_hex(16)
        for i, host in enumerate(hosts):
            lab.start_node(
                host,
                tmp,
                "--cluster",
                cluster,
                "--node-id",
                f"node-{i}",
                "--weight",
                str([5, 3, 2][i]),
                "--model",
                str(tiny_smollm2),
                env={"EXO_TP_SECRET": secret},
            )
        wait_ready([h.url for h in hosts], nodes=3)
        yield Lab(lab, hosts, cluster, tmp)
    finally:
        lab.down()


@pytest.fixture(scope="module")
def reference(tiny_smollm2: Path) -> str:
    return mlx_lm_reference(tiny_smollm2, QUESTION, 24).text


def test_nodes_discover_each_other_and_agree_on_a_leader(lab: Lab) -> None:
    views = [cluster_view(url) for url in lab.urls]
    for view in views:
        assert sorted(n.node_id for n in view.nodes if n.alive) == [
            "node-0",
            "node-1",
            "node-2",
        ]
        assert view.leader == "node-0"
    hosts = {n.node_id: n.host for n in views[2].nodes}
    assert hosts == {f"node-{i}": h.ip for i, h in enumerate(lab.hosts)}
    plan = plan_view(lab.urls[1])
    assert plan.nodes == ("node-0", "node-1", "node-2") and plan.plan is not None
    assert plan.plan.weights == pytest.approx([0.5, 0.3, 0.2])


def test_openai_client_matches_single_device(lab: Lab, reference: str) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    whole = lab.client(0).chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=24
    )
    assert whole.choices[0].message.content == reference
    stream = lab.client(2).chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=24, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reference


def test_wrong_secret_is_not_admitted(lab: Lab) -> None:
    intruder = lab.lab.add_host()
    lab.lab.start_node(
        intruder,
        lab.tmp,
        "--cluster",
        lab.cluster,
        "--node-id",
        "intruder",
        "--model",
        "smollm2-135m",
        "--no-bench",
        env={"EXO_TP_SECRET": secrets.token_hex(16)},
    )  # not the cluster's
    try:
        # Wait for the event that decides admission: every member has resolved the intruder's
        # announcement and refused it, and the intruder has refused every member's. Only then
        # is "not admitted" a fact rather than "not yet".
        def refused(host: Host, names: list[str]) -> bool:
            text = host.log.read_text() if host.log and host.log.exists() else ""
            return all(f"ignored announcement {name}-" in text for name in names)

        members = [f"node-{i}" for i in range(len(lab.hosts))]
        deadline = time.monotonic() + 90
        while not (all(refused(h, ["intruder"]) for h in lab.hosts) and refused(intruder, members)):
            assert time.monotonic() < deadline, "an announcement was never refused"
            time.sleep(0.5)
        for url in lab.urls:
            ids = [n.node_id for n in cluster_view(url).nodes]
            assert "intruder" not in ids
        intruder_view = cluster_view(intruder.url)
        assert [n.node_id for n in intruder_view.nodes] == ["intruder"]
        assert plan_view(lab.urls[0]).nodes == ("node-0", "node-1", "node-2")
    finally:
        lab.lab.stop_node(intruder)


def test_killed_worker_fails_the_request_fast_then_cluster_recovers(
    lab: Lab, reference: str
) -> None:
    epoch = plan_view(lab.urls[0]).epoch
    assert epoch is not None
    outcome: dict[str, object] = {}
    first_token = threading.Event()

    def long_request() -> None:
        try:
            stream = lab.client(1).chat.completions.create(
                model=MODEL,
                temperature=0,
                max_tokens=2000,
                stream=True,
                messages=[{"role": "user", "content": "Write a very long story."}],
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    first_token.set()
            outcome["result"] = "finished"
        except APIError as error:
            outcome["result"] = error
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=long_request)
    thread.start()
    assert first_token.wait(120), "generation never started"
    victim = worker_pids(lab.hosts[2].name)
    assert victim, "no worker process found in node-2's namespace"
    os.kill(victim[0], signal.SIGKILL)
    killed = time.monotonic()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the in-flight request hung"
    assert isinstance(outcome["result"], APIError), outcome
    assert float(outcome["at"]) - killed < 10  # type: ignore[arg-type]

    wait_ready(lab.urls, nodes=3, timeout=180)
    assert (plan_view(lab.urls[0]).epoch or 0) > epoch
    again = lab.client(2).chat.completions.create(
        model=MODEL, temperature=0, max_tokens=24, messages=[{"role": "user", "content": QUESTION}]
    )
    assert again.choices[0].message.content == reference
