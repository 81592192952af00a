"""A model let go when asked or when idle (issue #59 point 2), on 2 uneven nodes, through the
official ollama client: ``keep_alive: 0`` with nothing to answer unloads the model now (every
node's rank process exits, ``/api/ps`` lists nothing) and the next request loads it again (a
503 while it loads, then the same greedy text as before); ``keep_alive: "3s"`` keeps it 3 s
once idle (``/api/ps`` says until when) and then lets it go; ``/v1/models/unload`` does what
``keep_alive: 0`` does; a bad duration is a 400 naming the syntax."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ollama
import psutil
import pytest
from cluster_helpers import LocalCluster, http_json, local_cluster, until

GREEDY = {"temperature": 0, "num_predict": 8}


@pytest.fixture(scope="module")
def cluster(tiny_smollm2: Path) -> Iterator[LocalCluster]:
    with local_cluster(2, weights=[2, 1], model=str(tiny_smollm2)) as running:
        yield running


@pytest.fixture
def client(cluster: LocalCluster) -> ollama.Client:
    return ollama.Client(host=cluster.urls[0], timeout=120)


def _answer(client: ollama.Client, prompt: str, **extra: Any) -> str:
    """The greedy answer, once the cluster serves (a 503 while the model loads)."""

    def attempt() -> str | None:
        try:
            return client.generate(model="m", prompt=prompt, options=GREEDY, **extra).response
        except ollama.ResponseError as error:
            assert error.status_code == 503, error
            return None

    return str(until(attempt, "served"))


def _ranks(cluster: LocalCluster) -> list[psutil.Process]:
    children = psutil.Process(cluster.proc.pid).children(recursive=True)
    return [p for p in children if "exo_tp.runtime.rank" in " ".join(p.cmdline())]


def test_keep_alive_zero_unloads_now_and_a_request_loads_it_again(
    cluster: LocalCluster, client: ollama.Client
) -> None:
    before = _answer(client, "Once upon a time")
    assert [m.model for m in client.ps().models]
    assert len(_ranks(cluster)) == 2  # one rank a node

    done = client.generate(model="m", prompt="", keep_alive=0)
    assert done.done_reason == "unload" and done.done
    assert not client.ps().models
    until(lambda: not _ranks(cluster), "every rank gone")
    cards = http_json(f"{cluster.urls[1]}/v1/models")[1]["data"]
    assert not any(card["loaded"] for card in cards)

    assert _answer(client, "Once upon a time") == before
    assert [m.model for m in client.ps().models]


def test_keep_alive_seconds_lets_the_model_go_once_idle(
    cluster: LocalCluster, client: ollama.Client
) -> None:
    _answer(client, "Hello", keep_alive="3s")
    running = client.ps().models
    assert len(running) == 1 and running[0].expires_at is not None
    left = running[0].expires_at - datetime.datetime.now(datetime.timezone.utc)
    # from the request's end (the server's clock is this one)
    assert datetime.timedelta(seconds=-0.5) <= left <= datetime.timedelta(seconds=3.5)
    shown = http_json(f"{cluster.urls[0]}/v1/cluster")[1]["model"]["keep_alive"]
    assert shown["pinned"] is True  # named with --model, kept 3 s all the same as asked
    assert shown["idle_seconds"] is not None and 0 <= shown["expires_in"] <= 3
    until(lambda: not client.ps().models, "unloaded after 3 s idle")


def test_the_unload_route_and_a_bad_duration(cluster: LocalCluster, client: ollama.Client) -> None:
    _answer(client, "Hi")
    status, body = http_json(f"{cluster.urls[1]}/v1/models/unload", {"model": "m"})
    assert (status, body["state"]) == (200, "unloaded")
    assert not client.ps().models
    status, body = http_json(
        f"{cluster.urls[0]}/api/generate", {"model": "m", "prompt": "x", "keep_alive": "5x"}
    )
    assert status == 400 and "invalid duration '5x'" in body["error"], body
