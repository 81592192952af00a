"""LoRA fine-tuning speed and memory: mlx-lm alone, mlx-lm data parallel, exo-tp sharded.

    flock /tmp/exo-tp-cpu.lock python bench/finetune.py [--model M] [--iters 3]

Every contender trains the same model on the same data (short generated sentences, one
global batch of ``--batch-size`` per step, LoRA rank 8 on every linear of every layer, Adam)
in fresh processes, one after another. The default model is random and llama-shaped, written
with mlx-lm's own classes the way the test suite writes its tiny models (tests/tiny_models.py):
hidden 512, 6 layers, FFN 1536, 8 heads / 4 KV heads, vocabulary 4096 (SmolLM2's tokenizer
cut to it), float32, 86 MB; SmolLM2-135M (``--model smollm2-135m``) takes ~15 s per step in
one process on this machine, too slow for one run of six contenders.

- mlx-lm LoRA on one device (`mlx_lm.lora`'s train_model);
- mlx-lm's data-parallel LoRA on 2 ranks (the same, started on the MLX ring: every rank holds
  the whole model and half of each batch);
- `exo-tp finetune` on 2 ranks, shares 1:1 and 0.7:0.3 (of the base rows and of each batch),
  each with prefetch on and off;
- a fine-tuning job on a running 2-node `exo-tp run` cluster, through OpenAI's fine-tuning API
  (the `openai` SDK): only the first node has the model files, so the second takes its rows of
  the base through the weights transfer (the bytes each node fetched are reported).

``--quick``: 2 steps of a 2-layer, 128-wide bench model, and only mlx-lm on one process and on
2 ranks, exo-tp 1:1 (prefetch on) and the cluster (a sanity run; each contender left out runs
the same code with other numbers).

Training tokens/s is the median over the steps after the first (which compiles); peak memory
is each rank's peak while training (the weights it holds included). On this 2-core machine the
two ranks share one memory bus and a loopback link, and identical cores make uneven shares
slower by construction (the bigger share sets the pace: ideal 0.5/0.7 of even). The last part
is a prediction, not a measurement: the cost model (exo_tp/finetune/cost.py) for a 4-node Mac
cluster training a 70B model in 4-bit. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import ROOT, WorkerResult, env, resolve, worker_result

# The bench model (see the docstring); tiny_models writes it with mlx-lm's classes.
BENCH_CONFIG = dict(
    model_type="llama",
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=4096,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)
# --quick's: the same kind of model, small enough that its steps cost next to nothing.
QUICK_CONFIG = {
    **BENCH_CONFIG,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}

WORDS = "the sea is blue and the sky is wide a ship sails over the waves under the stars at night"


class MlxLmTraining(WorkerResult):
    """What rank 0 of an mlx-lm LoRA run writes: tokens/s of every step, each rank's peak
    memory (bytes)."""

    tps: list[float]
    peaks: list[float]


# One mlx-lm LoRA run (one rank of a data-parallel run when MLX_RANK is set): train_model with
# the options `mlx_lm.lora --train` passes, reporting every step; rank 0 writes the JSON.
_MLX_LM = """
import sys, types
import mlx.core as mx, numpy as np
from mlx_lm import load
from mlx_lm.lora import CONFIG_DEFAULTS, train_model
from mlx_lm.tuner.callbacks import TrainingCallback
from mlx_lm.tuner.datasets import load_dataset
from finetune import MlxLmTraining
model_dir, data, out, iters, batch, result = sys.argv[1:7]
args = types.SimpleNamespace(**{**CONFIG_DEFAULTS, "model": model_dir, "data": data,
    "train": True, "iters": int(iters), "batch_size": int(batch), "num_layers": -1,
    "adapter_path": out, "learning_rate": 1e-4, "steps_per_report": 1, "save_every": 10**6})
class Steps(TrainingCallback):
    def __init__(self): self.tps = []
    def on_train_loss_report(self, info): self.tps.append(info["tokens_per_second"])
np.random.seed(0)
model, tok = load(model_dir)
train_set, valid_set, _ = load_dataset(args, tok)
steps = Steps()
mx.reset_peak_memory()
train_model(args, model, train_set, valid_set, steps)
group = mx.distributed.init()
peaks = mx.zeros((group.size(),)).at[group.rank()].add(mx.get_peak_memory())
peaks = mx.distributed.all_sum(peaks, stream=mx.cpu) if group.size() > 1 else peaks
mx.eval(peaks)  # on every rank: a rank leaving before its peers' all_sum breaks the ring
if group.rank() == 0:
    with open(result, "w") as file:
        file.write(MlxLmTraining(tps=steps.tps, peaks=peaks.tolist()).model_dump_json())
"""


def write_data(folder: Path, count: int = 32) -> Path:
    rng = random.Random(1)
    folder.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps(
            {"text": " ".join(rng.choice(WORDS.split()) for _ in range(rng.randint(12, 20)))}
        )
        for _ in range(count)
    ]
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")  # no valid.jsonl: no eval
    return folder


def bench_model(folder: Path, config: dict[str, Any]) -> Path:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from tiny_models import write_tiny_model

    return write_tiny_model(folder, config, resolve("smollm2-135m"))


def mlx_lm_run(
    model: Path, data: Path, tmp: Path, iters: int, batch: int, ranks: int
) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from exo_tp.transport.ports import free_ports
    from exo_tp.transport.ring import ring_env, write_hostfile
    from exo_tp.transport.ring_wait import WAIT_ENV

    result = tmp / "mlx-lm.json"
    cmd = [
        sys.executable,
        "-c",
        _MLX_LM,
        str(model),
        str(data),
        str(tmp / "adapters"),
        str(iters),
        str(batch),
        str(result),
    ]
    if ranks == 1:
        subprocess.run(cmd, check=True, capture_output=True, env=env())
    else:
        hostfile = tmp / "hosts.json"
        write_hostfile(hostfile, [f"127.0.0.1:{p}" for p in free_ports(ranks)])
        # mlx-lm as users run it: its ranks spin in their ring waits (exo_tp.transport.ring_wait).
        base = {k: v for k, v in env().items() if k not in ("MLX_RANK", "MLX_HOSTFILE")}
        base[WAIT_ENV] = "spin"
        procs = [
            subprocess.Popen(
                cmd,
                env={**base, **ring_env(r, hostfile, base)},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            for r in range(ranks)
        ]
        for p in procs:
            _, err = p.communicate()
            if p.returncode:
                raise SystemExit(f"mlx-lm data parallel failed: {err.decode()[-2000:]}")
    out = worker_result(result.read_text(), MlxLmTraining)
    return {"tps": statistics.median(out.tps[1:]), "peaks": [int(p) for p in out.peaks]}


def exo_tp_run(
    model: Path, data: Path, tmp: Path, iters: int, batch: int, weights: list[float], prefetch: bool
) -> dict[str, Any]:
    report = tmp / "report.json"
    cmd = [
        sys.executable,
        "-m",
        "exo_tp",
        "finetune",
        "--model",
        str(model),
        "--data",
        str(data),
        "--ranks",
        str(len(weights)),
        "--weights",
        ",".join(map(str, weights)),
        "--iters",
        str(iters),
        "--batch-size",
        str(batch),
        "--num-layers",
        "-1",
        "--learning-rate",
        "1e-4",
        "--steps-per-report",
        "1",
        "--adapter-path",
        str(tmp / "adapters"),
        "--report-out",
        str(report),
        "--prefetch",
        "on" if prefetch else "off",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env())
    if done.returncode:
        raise SystemExit(f"exo-tp finetune failed: {done.stderr[-2000:]}")
    from exo_tp.wire.finetune_job import FinetuneReport

    ranks = FinetuneReport.model_validate_json(report.read_text()).ranks
    tps = [s.tokens_per_second for s in ranks[0].steps][1:]
    return {
        "tps": statistics.median(tps),
        "peaks": [r.train_peak for r in ranks],
        "held": [r.held_bytes for r in ranks],
        "base": ranks[0].base_bytes,
    }


def _node(index: int, port: int, cluster: str, model: Path | None, home: Path) -> Any:
    args = [sys.executable, "-m", "exo_tp", "run", "--host", "127.0.0.1", "--api-port", str(port)]
    args += ["--node-id", f"b{index}", "--cluster", cluster, "--no-bench", "--rebalance", "off"]
    args += ["--stall-timeout", "600", *(["--model", str(model)] if model else [])]
    return subprocess.Popen(
        args,
        env={**env(), "EXO_TP_HOME": str(home), "EXO_TP_SECRET": cluster},
        stdout=subprocess.DEVNULL,
        stderr=(home / f"b{index}.log").open("w"),
        start_new_session=True,
    )


def cluster_run(model: Path, data: Path, tmp: Path, iters: int, batch: int) -> dict[str, Any]:
    """A job on a 2-node cluster (node b1 without the model files), via the openai SDK."""
    import signal
    import urllib.request

    from openai import OpenAI

    sys.path.insert(0, str(ROOT))
    from exo_tp.transport.ports import free_ports

    ports = free_ports(2)
    cluster = f"bench-{os.getpid()}-{ports[0]}"
    nodes = [_node(i, p, cluster, model if i == 0 else None, tmp) for i, p in enumerate(ports)]
    url = f"http://127.0.0.1:{ports[0]}"
    try:
        deadline = time.monotonic() + 300
        while True:  # until the cluster serves over both nodes
            try:
                with urllib.request.urlopen(f"{url}/v1/plan", timeout=2) as answer:
                    plan = json.loads(answer.read())
                if plan.get("state") == "ready" and len(plan.get("nodes", [])) == 2:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"the bench cluster never formed (logs in {tmp})")
            time.sleep(0.25)  # formation is not measured: only the steps' tokens/s are
        api = OpenAI(base_url=f"{url}/v1", api_key="none")
        raw = (data / "train.jsonl").read_bytes()
        train = api.files.create(file=("train.jsonl", raw), purpose="fine-tune")
        job = api.fine_tuning.jobs.create(
            model=str(model),
            training_file=train.id,
            hyperparameters={
                "n_iters": iters,
                "batch_size": batch,
                "learning_rate_multiplier": 10.0,  # 1e-4, as the other contenders
            },
            extra_body={"lora": {"layers": -1}},
        )
        while job.status not in ("succeeded", "failed", "cancelled"):
            time.sleep(0.25)
            job = api.fine_tuning.jobs.retrieve(job.id)
        if job.status != "succeeded":
            raise SystemExit(f"the cluster job {job.status}: {job.error}")
        events = api.fine_tuning.jobs.list_events(job.id, limit=100).data[::-1]
        tps = [e.data["tokens_per_second"] for e in events if e.data and e.data.get("step")]
        tps = [t for t in tps if t is not None][1:]
        extra = job.model_extra or {}
        return {
            "tps": statistics.median(tps),
            "peaks": list(extra.get("peak_memory", {}).values()),
            "fetched": extra.get("fetched_bytes", {}),
        }
    finally:
        for node in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGTERM)
        for node in nodes:
            node.wait(30)


def mac_cluster_prediction() -> dict[str, Any]:
    """The cost model's prediction for 4 Macs (assumed figures, not measured here) training a
    Llama-3.1-70B-shaped model in 4-bit (group 64) with LoRA rank 8 on every linear."""
    sys.path.insert(0, str(ROOT))
    from exo_tp.finetune.cost import (
        Device,
        Workload,
        base_bytes,
        estimate_replicas,
        estimate_sharded,
    )
    from exo_tp.plan.cost import LinkCost
    from exo_tp.plan.spec import spec_from_config

    spec = spec_from_config(
        {
            "model_type": "llama",
            "hidden_size": 8192,
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "intermediate_size": 28672,
            "vocab_size": 128256,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "quantization": {"group_size": 64, "bits": 4},
        }
    )
    gb = 10**9
    # Memory a process may use (of 192/128/48/32 GB) and sustained bf16 training FLOP/s
    # (about 60% of each GPU's peak), both assumed.
    devices = [
        Device(name="Mac Studio M2 Ultra 192GB", memory=180 * gb, flops=16e12),
        Device(name="Mac Studio M4 Max 128GB", memory=118 * gb, flops=11e12),
        Device(name="MacBook Pro M4 Pro 48GB", memory=40 * gb, flops=5.5e12),
        Device(name="Mac mini M4 32GB", memory=26 * gb, flops=2.6e12),
    ]
    link = LinkCost(latency=50e-6, bandwidth=5e9, measured=False)  # Thunderbolt 5, assumed
    h, ffn, kv = 8192, 28672, 1024
    lora = 8 * 80 * ((h + h) * 2 + (h + kv) * 2 + (h + ffn) * 3)
    work = Workload(tokens=4 * 512, lora_params=lora)
    memory = [d.memory for d in devices]
    speed = [d.flops for d in devices]
    even = [1.0] * 4
    estimates = [
        estimate_replicas(spec, devices[:1], work, link, "mlx-lm, one M2 Ultra"),
        estimate_replicas(spec, devices, work, link, "mlx-lm data parallel"),
    ]
    for name, mem, spd in (
        ("base and batch even", even, even),
        ("base by memory, batch by speed", memory, speed),
        ("base even, batch by speed", even, speed),
    ):
        for prefetch in (True, False):
            estimates.append(
                estimate_sharded(
                    spec,
                    devices,
                    mem,
                    spd,
                    work,
                    link,
                    prefetch,
                    f"exo-tp {name}, prefetch {'on' if prefetch else 'off'}",
                )
            )
    return {
        "model": "llama 70B-shaped, 4-bit g64",
        "base_gb": base_bytes(spec) / gb,
        "tokens_per_step": work.tokens,
        "link": "50 us, 5 GB/s (assumed)",
        "estimates": [e.model_dump() for e in estimates],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model",
        help="a model folder or prepared name (default: the random llama-shaped bench model)",
    )
    parser.add_argument("--iters", type=int, default=3, help="steps per run (>= 2)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument(
        "--quick", action="store_true", help="a sanity run: 2 steps, four contenders, tiny model"
    )
    args = parser.parse_args()
    if args.quick:
        args.iters = 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results: dict[str, dict[str, Any]] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-finetune-") as tmp:
        config = QUICK_CONFIG if args.quick else BENCH_CONFIG
        model = resolve(args.model) if args.model else bench_model(Path(tmp) / "model", config)
        data = write_data(Path(tmp) / "data")
        runs = [
            (
                "mlx-lm, 1 process",
                lambda t: mlx_lm_run(model, data, t, args.iters, args.batch_size, 1),
            ),
            (
                "mlx-lm data parallel, 2 ranks",
                lambda t: mlx_lm_run(model, data, t, args.iters, args.batch_size, 2),
            ),
        ]
        shares = (("even 1:1", [1.0, 1.0]), ("uneven 0.7:0.3", [0.7, 0.3]))
        for label, weights in shares[:1] if args.quick else shares:
            for prefetch in (True,) if args.quick else (True, False):
                runs.append(
                    (
                        f"exo-tp {label}, prefetch {'on' if prefetch else 'off'}",
                        lambda t, w=weights, p=prefetch: exo_tp_run(
                            model, data, t, args.iters, args.batch_size, w, p
                        ),
                    )
                )
        runs.append(
            (
                "exo-tp cluster job, 2 nodes (API)",
                lambda t: cluster_run(model, data, t, args.iters, args.batch_size),
            )
        )
        for index, (label, run) in enumerate(runs):
            folder = Path(tmp) / f"run{index}"
            folder.mkdir()
            results[label] = run(folder)
            print(f"{label}: {results[label]['tps']:.1f} tok/s", file=sys.stderr, flush=True)
    single = results["mlx-lm, 1 process"]["tps"]
    print(
        f"model {args.model or 'bench llama'}, batch {args.batch_size}, {args.iters} steps per run "
        f"(median after the first)"
    )
    print(f"{'contender':38} {'tok/s':>7} {'vs 1':>6}  peak memory per rank (MB)")
    for label, r in results.items():
        peaks = " / ".join(f"{p / 1e6:.0f}" for p in r["peaks"])
        fetched = r.get("fetched")
        moved = (
            "  fetched MB " + " / ".join(f"{n} {b / 1e6:.1f}" for n, b in fetched.items())
            if fetched
            else ""
        )
        print(f"{label:38} {r['tps']:7.1f} {r['tps'] / single:5.2f}x  {peaks}{moved}")
    prediction = mac_cluster_prediction()
    print(
        "\npredicted by the cost model (assumed devices and link), "
        f"{prediction['model']}, {prediction['base_gb']:.1f} GB of weights, "
        f"{prediction['tokens_per_step']} tokens per step:"
    )
    for e in prediction["estimates"]:
        peaks = " / ".join(f"{r['peak_bytes'] / 1e9:.0f}" for r in e["ranks"])
        print(
            f"  {e['contender']:34} {e['tokens_per_second']:7.1f} tok/s  "
            f"peak GB {peaks}  {'fits' if e['fits'] else 'DOES NOT FIT'} {e['note']}"
        )
    summary = {
        "model": args.model
        or (
            f"bench llama (hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, "
            "float32)"
        ),
        "batch_size": args.batch_size,
        "iters": args.iters,
        "seconds": round(time.perf_counter() - started, 1),
        "measured": results,
        "ratios": {k: v["tps"] / single for k, v in results.items()},
        "predicted_mac_cluster": prediction,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
