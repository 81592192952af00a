"""Several models resident at once (issue #59 points 1, 2, 5, 6) on 3 uneven nodes (5, 3, 1):
the ``--model`` one (pinned) and two more from ``--models-dir``, loaded when a request names
them, with ``--max-models 2``.

- two models resident answer requests at the same time, each equal to single-device mlx-lm;
  each has its own group (``/v1/cluster``'s groups: model, ranks over every node, pinned or
  not), ``/api/ps`` and ``/v1/models`` list both, and the pinned one did not re-form;
- a third model named evicts the least recently used unpinned one (its rank processes exit;
  the pinned one stays, untouched), and answers as mlx-lm does;
- Ollama's ``keep_alive: 0`` unloads the model named (and only it);
- a model bigger than the cluster's memory is a 400 naming the memory it needs.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ollama
import psutil
import pytest
from cluster_helpers import LocalCluster, http_json, local_cluster, until
from helpers import mlx_lm_reference
from openai import APIStatusError, OpenAI
from tiny_models import TINY_SMOLLM2, write_tiny_model

PROMPT = "The three primary colors are"
TOKENS = 8


@pytest.fixture(scope="module")
def models(default_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three tiny SmolLM2-shaped models (about 32 MB each) with their own depth and random
    weights (a model's key is its config and file layout), the first pinned, the other two in
    a --models-dir folder; and a bigger one there (205 MB) that the cluster's memory cannot
    hold."""
    smollm2 = default_models["smollm2-135m"]
    config = {**json.loads((smollm2 / "config.json").read_text()), **TINY_SMOLLM2}
    root = tmp_path_factory.mktemp("resident")
    tiny = [
        write_tiny_model(root / where, {**config, "num_hidden_layers": layers}, smollm2, seed=seed)
        for seed, (where, layers) in enumerate(
            (("pinned", 4), ("library/b", 3), ("library/c", 5)), start=1
        )
    ]
    big = {**config, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 8}
    return [*tiny, write_tiny_model(root / "library/big", big, smollm2)]


@pytest.fixture(scope="module")
def cluster(models: list[Path]) -> Iterator[LocalCluster]:
    # 50 MB lent by each node: 135 MB for models (the planner's 10% headroom)
    extra = (
        *("--models-dir", str(models[1].parent), "--max-models", "2", "--max-memory", "50MB"),
        "--strict-model-names",
    )
    with local_cluster(3, weights=[5, 3, 1], model=str(models[0]), extra=extra) as running:
        yield running


def _complete(client: OpenAI, model: Path) -> str | None:
    """The greedy answer, None while the model loads (a 503)."""
    try:
        reply = client.chat.completions.create(
            model=str(model),
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=TOKENS,
            temperature=0,
        )
    except APIStatusError as error:
        assert error.status_code == 503, error
        return None
    return reply.choices[0].message.content


def _served(client: OpenAI, model: Path) -> str:
    return str(until(lambda: _complete(client, model), f"{model.name} served"))


def _reference(model: Path) -> str:
    return mlx_lm_reference(model, PROMPT, TOKENS).text


def _groups(cluster: LocalCluster, node: int = 0) -> dict[str, dict[str, Any]]:
    view = http_json(f"{cluster.urls[node]}/v1/cluster")[1]
    return {g["model"]: g for g in view["groups"]}


def _rank_count(cluster: LocalCluster) -> int:
    children = psutil.Process(cluster.proc.pid).children(recursive=True)
    return sum("exo_tp.runtime.rank" in " ".join(p.cmdline()) for p in children)


def test_two_models_resident_answer_at_once_like_mlx_lm(
    cluster: LocalCluster, models: list[Path]
) -> None:
    client = OpenAI(base_url=f"{cluster.urls[1]}/v1", api_key="unused", max_retries=0)
    pinned, second = models[0], models[1]
    assert _served(client, pinned) == _reference(pinned)
    epoch = _groups(cluster)[str(pinned)]
    assert _served(client, second) == _reference(second)

    answers: dict[str, list[str | None]] = {str(pinned): [], str(second): []}

    def ask(model: Path) -> None:
        answers[str(model)].append(_complete(client, model))

    threads = [threading.Thread(target=ask, args=(m,)) for m in (pinned, second) * 3]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers[str(pinned)] == [_reference(pinned)] * 3
    assert answers[str(second)] == [_reference(second)] * 3

    groups = _groups(cluster)
    assert set(groups) == {str(pinned), str(second)}
    assert groups[str(pinned)]["pinned"] and not groups[str(second)]["pinned"]
    for group in groups.values():
        assert group["state"] == "ready" and sorted(group["ranks"]) == [
            "local-0",
            "local-1",
            "local-2",
        ]
    # loading the second model did not re-form the first
    assert groups[str(pinned)]["epoch"] == epoch["epoch"]
    assert set(_groups(cluster, node=2)) == set(groups)  # a follower shows them too
    assert _rank_count(cluster) == 6
    running = ollama.Client(host=cluster.urls[2]).ps().models
    assert {m.model for m in running} == {str(pinned), str(second)}
    on_leader = ollama.Client(host=cluster.urls[0]).ps().models  # each one's own context
    assert all(m.context_length and m.context_length > 0 for m in on_leader), on_leader
    cards = http_json(f"{cluster.urls[2]}/v1/models")[1]["data"]
    assert {c["id"] for c in cards if c["loaded"]} == {str(pinned), str(second)}


def test_a_third_model_evicts_the_least_recently_used_unpinned_one(
    cluster: LocalCluster, models: list[Path]
) -> None:
    client = OpenAI(base_url=f"{cluster.urls[0]}/v1", api_key="unused", max_retries=0)
    pinned, second, third = models[:3]
    assert _served(client, second) == _reference(second)
    assert _served(client, pinned) == _reference(pinned)  # the pinned one used last
    before = _groups(cluster)[str(pinned)]
    assert _served(client, third) == _reference(third)
    groups = _groups(cluster)
    assert set(groups) == {str(pinned), str(third)}
    assert groups[str(pinned)]["epoch"] == before["epoch"]  # the eviction left it alone
    until(lambda: _rank_count(cluster) == 6, "the evicted model's ranks gone")
    assert _complete(client, pinned) == _reference(pinned)


def test_keep_alive_zero_unloads_the_model_named_only(
    cluster: LocalCluster, models: list[Path]
) -> None:
    client = OpenAI(base_url=f"{cluster.urls[0]}/v1", api_key="unused", max_retries=0)
    pinned, third = models[0], models[2]
    _served(client, third)
    ollama_client = ollama.Client(host=cluster.urls[1])
    done = ollama_client.generate(model=str(third), prompt="", keep_alive=0)
    assert done.done_reason == "unload"
    until(lambda: set(_groups(cluster)) == {str(pinned)}, "only the pinned model left")
    until(lambda: _rank_count(cluster) == 3, "the unloaded model's ranks gone")
    assert {m.model for m in ollama_client.ps().models} == {str(pinned)}
    assert _complete(client, pinned) == _reference(pinned)


def test_a_model_too_big_for_the_cluster_is_a_400_naming_its_size(
    cluster: LocalCluster, models: list[Path]
) -> None:
    big = models[3]
    request = {"model": str(big), "prompt": "x", "max_tokens": 1}

    def answer() -> tuple[int, dict[str, Any]] | None:
        code, body = http_json(f"{cluster.urls[1]}/v1/completions", request)
        return None if code == 503 else (code, body)  # 503: offered from its folder first

    code, body = until(answer, "answered")
    assert code == 400 and body["error"]["code"] == "model_too_large", body
    message = body["error"]["message"]
    assert "0.21 GB" in message and str(models[0]) in message, message
    assert set(_groups(cluster)) == {str(models[0])}  # nothing let go for it
    # several models listed: unloading a name none of them has is a 404, nothing let go
    code, body = http_json(f"{cluster.urls[0]}/v1/models/unload", {"model": "no-such-model"})
    assert code == 404 and body["error"]["code"] == "model_not_found", body
    assert set(_groups(cluster)) == {str(models[0])}
