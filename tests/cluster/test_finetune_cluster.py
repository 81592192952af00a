"""Fine-tuning on a running cluster's nodes, behind OpenAI's fine-tuning API, with the official
`openai` SDK against a real 3-node cluster in network namespaces (2 loopback nodes where
namespaces cannot be made) in which only the leader has the model files: the others take their
rows of the base through the weights transfer.

One job trains a tiny random llama on a small chat dataset (one rank per node, uneven rows of
the base, each node's share of every batch); its adapter must equal single-device mlx-lm LoRA
training (`mlx_lm.lora.train_model`, this process, same data, seed and hyper-parameters) within
fp32 noise, and so must its per-step losses; chatting with the ``ft:`` model must give
mlx_lm.generate's greedy text with that adapter. Then: bad inputs (each a 4xx naming the
problem, no job started), cancel, and a node killed mid-job (the job fails within 10 s naming
it, and the cluster serves again).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import signal
import time
import types
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import psutil
import pytest
from arch_configs import tiny_config
from cluster_helpers import (
    NamespaceLab,
    can_make_namespaces,
    http_json,
    loopback_nodes,
    wait_ready,
    worker_pids,
)
from helpers import loss_recorder
from openai import BadRequestError, NotFoundError, OpenAI
from tiny_models import write_tiny_model

# batch 3: a row of each batch for each of up to 3 nodes
EXAMPLES, VALID, BATCH, EPOCHS, LR_MULTIPLIER = 9, 3, 3, 1, 5000.0
LR = 1e-5 * LR_MULTIPLIER  # the server's base rate (mlx_lm.lora's default) times the multiplier
ITERS = EPOCHS * EXAMPLES // BATCH
WEIGHT_ATOL = 1e-5
LOSS_ATOL = 1e-4
WORDS = "the sea is blue and the sky is wide a ship sails over the waves under the stars at night"
FINISHED = ("succeeded", "failed", "cancelled")
COMMON = ["--strict-model-names", "--no-bench", "--stall-timeout", "300", "--rebalance", "off"]


def chat_lines(count: int, seed: int) -> str:
    rng = random.Random(seed)

    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS.split()) for _ in range(rng.randint(lo, hi)))

    rows = [
        {
            "messages": [
                {"role": "user", "content": words(3, 8)},
                {"role": "assistant", "content": words(3, 12)},
            ]
        }
        for _ in range(count)
    ]
    return "".join(json.dumps(r) + "\n" for r in rows)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, default_models: dict[str, Path]) -> Path:
    folder = tmp_path_factory.mktemp("ft-cluster")
    tokenizer = default_models["smollm2-135m"]
    write_tiny_model(folder / "llama", tiny_config("llama"), tokenizer)
    write_tiny_model(folder / "moe", tiny_config("qwen3_moe"), tokenizer)
    data = folder / "data"
    data.mkdir()
    (data / "train.jsonl").write_text(chat_lines(EXAMPLES, 0))
    (data / "valid.jsonl").write_text(chat_lines(VALID, 1))
    return folder


@dataclass
class Cluster:
    """The nodes under test: node 0 (the leader) has the model files, the others none."""

    urls: list[str]
    ids: list[str]
    kill: Callable[[int], None]  # SIGKILL node i and everything it started
    logs: list[Path]  # node i's log (a failed readiness wait shows their ends)


def _netns_cluster(models: Path, env: dict[str, str]) -> Iterator[Cluster]:
    """Three nodes, each in its own network namespace."""
    lab = NamespaceLab()
    lab.up()
    try:
        hosts = [lab.add_host() for _ in range(3)]
        secret = secrets.token_hex(16)
        for i, host in enumerate(hosts):
            files = ["--model", str(models / "llama"), "--model", str(models / "moe")]
            lab.start_node(
                host, models, "--cluster", f"ft-{lab.tag}", "--node-id", f"node-{i}",
                "--weight", str([5, 3, 2][i]), *COMMON, *(files if i == 0 else []),
                env={**env, "EXO_TP_SECRET": secret},
            )  # fmt: skip
        urls = [h.url for h in hosts]
        logs = [h.log for h in hosts if h.log is not None]
        wait_ready(urls, nodes=3, logs=logs)

        def kill(i: int) -> None:
            proc = hosts[i].proc
            assert proc is not None
            os.killpg(proc.pid, signal.SIGKILL)
            for pid in worker_pids(hosts[i].name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

        yield Cluster(urls, [f"node-{i}" for i in range(3)], kill, logs)
    finally:
        lab.down()


def _loopback_cluster(models: Path, env: dict[str, str]) -> Iterator[Cluster]:
    """Two nodes on 127.0.0.1 (where network namespaces cannot be made)."""
    files = ["--model", str(models / "llama"), "--model", str(models / "moe")]
    with loopback_nodes(
        [[*files, *COMMON, "--weight", "3"], [*COMMON, "--weight", "2"]], None, models, env=env
    ) as running:

        def kill(i: int) -> None:
            node = next(
                p
                for p in psutil.Process().children(recursive=True)
                if p.cmdline()[-2:] == ["--node-id", f"n{i}"]
            )
            os.kill(node.pid, signal.SIGKILL)

        ids = [f"n{i}" for i in range(len(running.urls))]
        yield Cluster(running.urls, ids, kill, running.logs)


@pytest.fixture(scope="module")
def cluster(models: Path) -> Iterator[Cluster]:
    env = {"EXO_TP_HOME": str(models / "home")}  # files, jobs, adapters and weight stores
    if can_make_namespaces() is None:
        yield from _netns_cluster(models, env)
    else:
        yield from _loopback_cluster(models, env)


def client(cluster: Cluster, node: int = 0) -> OpenAI:
    return OpenAI(base_url=f"{cluster.urls[node]}/v1", api_key="none", max_retries=0)


def upload(api: OpenAI, text: str, name: str = "data.jsonl") -> str:
    return api.files.create(file=(name, text.encode()), purpose="fine-tune").id


def wait_job(api: OpenAI, job_id: str, timeout: float = 240) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = api.fine_tuning.jobs.retrieve(job_id)
        if job.status in FINISHED:
            return job
        time.sleep(0.5)
    raise TimeoutError(f"job {job_id} still {job.status} after {timeout}s")


def mlx_lm_lora(
    model: Path, data: Path, out: Path, layers: int, optimizer: str = "sgd", lr: float = LR
) -> tuple[list, list]:
    """mlx-lm's own LoRA training on one device, as `mlx_lm.lora --train` would run it with
    the job's settings; its train and validation losses."""
    from mlx_lm import load
    from mlx_lm.lora import CONFIG_DEFAULTS, train_model
    from mlx_lm.tuner.datasets import load_dataset

    args = types.SimpleNamespace(
        **{
            **CONFIG_DEFAULTS,
            "model": str(model),
            "data": str(data),
            "train": True,
            "iters": ITERS,
            "batch_size": BATCH,
            "num_layers": layers,
            "adapter_path": str(out),
            "optimizer": optimizer,
            "learning_rate": lr,
            "seed": 0,
            "steps_per_report": 1,
            "steps_per_eval": max(1, ITERS // 4),
            "val_batches": -1,
            "save_every": ITERS,
        }
    )

    np.random.seed(args.seed)  # as mlx_lm.lora.run does first
    loaded, tokenizer = load(str(model))
    train_set, valid_set, _ = load_dataset(args, tokenizer)
    losses = loss_recorder()
    train_model(args, loaded, train_set, valid_set, losses)
    return losses.train, losses.val


@pytest.fixture(scope="module")
def trained(cluster: Cluster, models: Path) -> Any:
    api = client(cluster, 1)  # a member: it passes the requests on to the leader
    train = upload(api, (models / "data" / "train.jsonl").read_text(), "train.jsonl")
    valid = upload(api, (models / "data" / "valid.jsonl").read_text(), "valid.jsonl")
    job = api.fine_tuning.jobs.create(
        model=str(models / "llama"),
        training_file=train,
        validation_file=valid,
        seed=0,
        suffix="sea",
        method={
            "type": "supervised",
            "supervised": {
                "hyperparameters": {
                    "n_epochs": EPOCHS,
                    "batch_size": BATCH,
                    "learning_rate_multiplier": LR_MULTIPLIER,
                    # extension: SGD, so that no optimizer normalisation amplifies fp32 noise
                    # (Adam turns a 1e-9 gradient into a full step) or hides a wrong gradient
                    "optimizer": "sgd",
                }
            },
        },
    )
    assert job.status in ("queued", "running")
    return wait_job(api, job.id)


def download_adapter(api: OpenAI, job: Any, folder: Path) -> Path:
    """A succeeded job's result files (the adapter, for mlx_lm)."""
    folder.mkdir()
    for file_id in job.result_files:
        name = api.files.retrieve(file_id).filename.removeprefix(f"{job.id}-")
        (folder / name).write_bytes(api.files.content(file_id).read())
    return folder


def test_job_equals_single_device_mlx_lm(
    cluster: Cluster, models: Path, trained: Any, tmp_path: Path
) -> None:
    job = trained
    assert job.status == "succeeded", job.error
    assert job.fine_tuned_model == f"ft:{models / 'llama'}:sea:{job.id}"
    assert job.model_extra["nodes"] == cluster.ids
    # the others had the rows of their serving shards; each fetched the rest of its rows,
    # not the model
    fetched = job.model_extra["fetched_bytes"]
    whole = (models / "llama" / "model.safetensors").stat().st_size
    assert fetched[cluster.ids[0]] == 0, fetched
    assert all(0 < fetched[n] < whole for n in cluster.ids[1:]), fetched
    api = client(cluster)
    events = api.fine_tuning.jobs.list_events(job.id, limit=100).data[::-1]  # oldest first
    metrics = [e.data for e in events if e.type == "metrics"]
    train = [m["train_loss"] for m in metrics if m.get("train_loss") is not None]
    val = [m["valid_loss"] for m in metrics if m.get("valid_loss") is not None]
    steps = [m["step"] for m in metrics if m.get("train_loss") is not None]
    assert steps == list(range(1, ITERS + 1))
    # the adapter, downloaded as the job's result files (for mlx_lm)
    adapter = download_adapter(api, job, tmp_path / "adapter")
    assert sorted(p.name for p in adapter.iterdir()) == [
        "adapter_config.json",
        "adapters.safetensors",
    ]
    layers = json.loads((adapter / "adapter_config.json").read_text())["num_layers"]
    ref_train, ref_val = mlx_lm_lora(models / "llama", models / "data", tmp_path / "ref", layers)
    ours, ref = (
        mx.load(str(adapter / "adapters.safetensors")),
        mx.load(str(tmp_path / "ref" / "adapters.safetensors")),
    )
    np.testing.assert_allclose(train, ref_train, rtol=0, atol=LOSS_ATOL)
    np.testing.assert_allclose(val, ref_val, rtol=0, atol=LOSS_ATOL)
    assert sorted(ours) == sorted(ref)
    worst = max((float(mx.abs(ours[k] - ref[k]).max()), k) for k in ref)
    assert worst[0] <= WEIGHT_ATOL, f"LoRA weight {worst[1]} differs by {worst[0]:.3g}"
    assert min(float(mx.abs(ref[k]).max()) for k in ref if k.endswith("lora_b")) > 1e-3
    checkpoints = api.fine_tuning.jobs.checkpoints.list(job.id).data
    assert checkpoints and checkpoints[0].step_number == ITERS


def test_fine_tuned_model_is_listed_and_chats_like_mlx_lm(
    cluster: Cluster, models: Path, trained: Any, tmp_path: Path
) -> None:
    from mlx_lm import generate, load

    name = trained.fine_tuned_model
    # Every node lists it: the leader's jobs reach a member with its next status exchange.
    deadline = time.monotonic() + 30
    for node in range(len(cluster.urls)):
        while name not in (listed := [m.id for m in client(cluster, node).models.list().data]):
            assert time.monotonic() < deadline, f"node {node} lists {listed}, not {name}"
            time.sleep(0.2)
    messages = [{"role": "user", "content": "the ship sails"}]
    deadline = time.monotonic() + 180
    while True:  # 503 while the cluster loads the base with the adapter
        status, answer = http_json(
            f"{cluster.urls[1]}/v1/chat/completions",
            {"model": name, "messages": messages, "max_tokens": 8, "temperature": 0},
            timeout=60,
        )
        if status == 200 or time.monotonic() > deadline:
            break
        assert status == 503, answer
        time.sleep(1)
    assert status == 200, answer
    adapter = tmp_path / "adapter"  # from the adapter route, as a user gets it for mlx_lm
    adapter.mkdir()
    for file in ("adapters.safetensors", "adapter_config.json"):
        url = f"{cluster.urls[1]}/v1/fine_tuning/jobs/{trained.id}/adapter/{file}"
        with urllib.request.urlopen(url, timeout=10) as response:
            (adapter / file).write_bytes(response.read())
    model, tokenizer = load(str(models / "llama"), adapter_path=str(adapter))
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    expected = generate(model, tokenizer, prompt=prompt, max_tokens=8, verbose=False)
    assert answer["choices"][0]["message"]["content"] == expected


# Adam (the default) at a learning rate where it is not chaotic (1e-4): see "Adam and fp32
# noise" in docs/finetune.md. On this data and cut (one row of each batch per node), one device
# against itself with each batch's gradient summed as three token-weighted rows differs by
# 2.8e-7 after step 1 and 1.2e-5 after steps 2 and 3 (`bench/finetune_adam_noise.py --chat
# --rows 1,1,1 --lr 1e-4 --steps 3`); this job, like `exo-tp finetune` on 3 local ranks, by
# 6.1e-7 and 1.4e-5. A wrong gradient moves a weight by O(lr) = 1e-4 per step.
ADAM_MULTIPLIER = 10.0
ADAM_ATOL = 4e-5


def test_adam_job_agrees_with_mlx_lm_within_summation_noise(
    cluster: Cluster, models: Path, trained: Any, tmp_path: Path
) -> None:
    api = client(cluster)
    train = upload(api, (models / "data" / "train.jsonl").read_text(), "train.jsonl")
    valid = upload(api, (models / "data" / "valid.jsonl").read_text(), "valid.jsonl")
    hyper = {"n_epochs": EPOCHS, "batch_size": BATCH, "learning_rate_multiplier": ADAM_MULTIPLIER}
    job = api.fine_tuning.jobs.create(
        model=str(models / "llama"),
        training_file=train,
        validation_file=valid,
        seed=0,
        method={"type": "supervised", "supervised": {"hyperparameters": hyper}},
    )
    job = wait_job(api, job.id)
    assert job.status == "succeeded", job.error
    assert job.hyperparameters.model_extra.get("optimizer", "adam") == "adam"
    adapter = download_adapter(api, job, tmp_path / "adapter")
    layers = json.loads((adapter / "adapter_config.json").read_text())["num_layers"]
    lr = 1e-5 * ADAM_MULTIPLIER
    ref_train, ref_val = mlx_lm_lora(
        models / "llama", models / "data", tmp_path / "ref", layers, "adam", lr
    )
    ours = mx.load(str(adapter / "adapters.safetensors"))
    ref = mx.load(str(tmp_path / "ref" / "adapters.safetensors"))
    worst = max((float(mx.abs(ours[k] - ref[k]).max()), k) for k in ref)
    assert worst[0] <= ADAM_ATOL, f"LoRA weight {worst[1]} differs by {worst[0]:.3g}"
    assert min(float(mx.abs(ref[k]).max()) for k in ref if k.endswith("lora_b")) > 2 * ADAM_ATOL
    events = api.fine_tuning.jobs.list_events(job.id, limit=100).data[::-1]
    train_losses = [e.data.get("train_loss") for e in events if e.type == "metrics"]
    train_losses = [x for x in train_losses if x is not None]
    np.testing.assert_allclose(train_losses, ref_train, rtol=0, atol=LOSS_ATOL)


BAD_FILES = [
    ("bad-json", '{"text": "fine"}\n{"text": broken\n', "line 2"),
    ("not-object", '{"text": "fine"}\n[1, 2]\n', "line 2"),
    ("mixed", '{"text": "fine"}\n{"prompt": "a", "completion": "b"}\n', "line 2"),
    ("no-role", '{"messages": [{"content": "hi"}]}\n', "line 1"),
    ("empty", "\n\n", "no examples"),
]


@pytest.mark.parametrize("case", BAD_FILES, ids=[c[0] for c in BAD_FILES])
def test_bad_file_is_400_naming_the_line(cluster: Cluster, case: tuple[str, str, str]) -> None:
    _, text, expected = case
    with pytest.raises(BadRequestError) as error:
        upload(client(cluster), text)
    assert expected in error.value.message


def test_bad_jobs_are_refused_before_they_start(cluster: Cluster, models: Path) -> None:
    api = client(cluster)
    before = len(api.fine_tuning.jobs.list().data)
    small = upload(api, chat_lines(3, 2))
    llama = str(models / "llama")
    for kwargs, error_type, words in [
        (dict(model=llama, training_file=small, hyperparameters={"batch_size": 4}),
         BadRequestError, "fewer than the batch size"),
        (dict(model="no-such-model", training_file=small), NotFoundError, "does not exist"),
        (dict(model=str(models / "moe"), training_file=small), BadRequestError,
         "mixture of experts"),
        (dict(model=llama, training_file="file-nope"), BadRequestError, "does not exist"),
    ]:  # fmt: skip
        with pytest.raises(error_type) as raised:
            api.fine_tuning.jobs.create(**kwargs)  # type: ignore[arg-type]
        assert words in raised.value.message
    # over the API's body limit: a 413, nothing stored
    status, body = http_json(f"{cluster.urls[0]}/v1/files", b"x" * (25 << 20))
    assert status == 413, body
    assert len(api.fine_tuning.jobs.list().data) == before


def test_cancel_frees_the_cluster(cluster: Cluster, models: Path, trained: Any) -> None:
    api = client(cluster)
    train = upload(api, chat_lines(64, 3))
    job = api.fine_tuning.jobs.create(
        model=str(models / "llama"), training_file=train, hyperparameters={"batch_size": BATCH}
    )
    deadline = time.monotonic() + 120
    while api.fine_tuning.jobs.retrieve(job.id).status != "running":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    # generation waits for the job: a 503 with Retry-After and the job's progress
    status, busy = http_json(
        f"{cluster.urls[0]}/v1/chat/completions",
        {"model": str(models / "llama"), "messages": [{"role": "user", "content": "hi"}]},
    )
    assert status == 503 and busy["error"]["code"] == "fine_tuning", busy
    assert job.id in busy["error"]["message"]
    cancelled = time.monotonic()
    assert api.fine_tuning.jobs.cancel(job.id).status == "cancelled"
    assert time.monotonic() - cancelled < 10
    assert not _finetune_ranks()


def _finetune_ranks() -> list[psutil.Process]:
    ranks = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "exo_tp.finetune.worker" in " ".join(child.cmdline()):
                ranks.append(child)
        except psutil.NoSuchProcess:
            continue
    return ranks


def test_killed_node_fails_the_job_then_cluster_serves(
    cluster: Cluster, models: Path, trained: Any
) -> None:
    api = client(cluster)
    train = upload(api, chat_lines(64, 4))
    job = api.fine_tuning.jobs.create(
        model=str(models / "llama"), training_file=train, hyperparameters={"batch_size": BATCH}
    )
    deadline = time.monotonic() + 120
    while not api.fine_tuning.jobs.retrieve(job.id).model_extra["progress"]["step"]:
        assert time.monotonic() < deadline, "the job never started training"
        time.sleep(0.2)
    cluster.kill(len(cluster.ids) - 1)
    killed = time.monotonic()
    done = wait_job(api, job.id, timeout=30)
    assert done.status == "failed"
    assert time.monotonic() - killed < 10
    assert cluster.ids[-1] in done.error.message, done.error
    # the cluster serves again, without the killed node
    wait_ready(cluster.urls[:-1], nodes=len(cluster.ids) - 1, logs=cluster.logs[:-1])


def test_files_and_jobs_survive_a_restart(tmp_path: Path) -> None:
    """The node's state on disk, read back by a new node process's state (no cluster): files
    and finished jobs as they were; a job that was running is failed (its ranks died)."""
    from exo_tp.finetune.openai_schema import (
        Job,
        JobHyperparameters,
        JobMethod,
        JobSupervised,
        LoraOptions,
    )
    from exo_tp.finetune.state import FineTuneState

    state = FineTuneState(tmp_path)
    file = state.add_file("train.jsonl", chat_lines(2, 5).encode(), "fine-tune", 2, "chat")
    hp = JobHyperparameters(n_epochs=1, batch_size=1, learning_rate_multiplier=1.0)
    for job_id, status in (("ftjob-done", "succeeded"), ("ftjob-live", "running")):
        state.save_job(
            Job(
                id=job_id,
                created_at=1,
                hyperparameters=hp,
                method=JobMethod(supervised=JobSupervised(hyperparameters=hp)),
                model="m",
                seed=0,
                status=status,  # type: ignore[arg-type]
                training_file=file.id,
                iterations=2,
                lora=LoraOptions(layers=2),
            )
        )
    again = FineTuneState(tmp_path)
    assert again.files == {file.id: file}
    assert again.data_path(file.id).read_text() == chat_lines(2, 5)
    assert again.jobs["ftjob-done"].status == "succeeded"
    live = again.jobs["ftjob-live"]
    assert live.status == "failed" and live.error is not None
    assert live.error.code == "node_restarted"
    assert "restarted" in again.events("ftjob-live")[0].message
