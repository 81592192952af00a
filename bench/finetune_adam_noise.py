"""How far two exact LoRA trainings drift apart when only the order of a sum differs.

    nice python bench/finetune_adam_noise.py [--steps 10] [--lr 0.05] [--exo-tp]

The tiny llama and data of tests/ranks/test_finetune.py (random weights, hidden 384, 2 layers, 16
sentences, batch 4, LoRA rank 8 on every linear, learning rate ``--lr``), trained in this
process with mlx-lm's own pieces (load, linear_to_lora_layers, iterate_batches, default_loss,
mlx.optimizers), twice per optimizer:

- A takes each batch's gradient whole, as mlx-lm on one device does;
- B splits every batch into rows 0-2 and 3 (``--rows 3,1``: as two ranks with speeds 3:1
  would) and adds the parts' gradients weighted by their token counts: mathematically the same
  gradient, summed in another order (what exo-tp's token-weighted loss and mlx-lm's all-reduce
  compute).

It prints, after every step, the largest |A - B| over all LoRA weights, for SGD and for Adam.
``--chat``: the chat data of tests/cluster/test_finetune_cluster.py instead (with ``--rows
1,1,1``, its cluster's cut). ``--exo-tp`` also trains with Adam on local ranks (`exo-tp
finetune`, batch rows ``--rows``) and with `mlx_lm.lora`'s train_model for 1, 3 and
``--steps`` steps and prints the largest difference of their adapters: exo-tp's drift beside
the drift of a mere change of summation order. The last stdout line is one JSON object.

``--quick``: a smoke run: 1 step, and ``--exo-tp`` for that step only; the work folder is
removed at the end.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORDS = "the sea is blue and the sky is wide a ship sails over the waves under the stars at night"


def write_data(folder: Path) -> Path:
    """tests/ranks/test_finetune.py's data: 16 training and 4 validation sentences."""
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    for name, count in (("train", 16), ("valid", 4)):
        lines = [
            json.dumps(
                {"text": " ".join(rng.choice(WORDS.split()) for _ in range(rng.randint(5, 40)))}
            )
            for _ in range(count)
        ]
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def lora_run(
    model_dir: Path, data: Path, optimizer: str, lr: float, steps: int, rows: list[int], split: bool
) -> list[Any]:
    """The LoRA weights after every step (numpy), with whole or split-batch gradients (batches
    of ``sum(rows)``, split into runs of ``rows``)."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm import load
    from mlx_lm.tuner.datasets import CacheDataset, load_dataset
    from mlx_lm.tuner.trainer import default_loss, iterate_batches
    from mlx_lm.tuner.utils import linear_to_lora_layers

    np.random.seed(0)
    model, tokenizer = load(str(model_dir))
    args = types.SimpleNamespace(data=str(data), train=True, test=False, mask_prompt=False)
    train_set, _, _ = load_dataset(args, tokenizer)
    mx.random.seed(0)
    model.freeze()
    linear_to_lora_layers(model, -1, {"rank": 8, "dropout": 0.0, "scale": 20.0})
    model.train()
    opt = {"sgd": optim.SGD, "adam": optim.Adam}[optimizer](learning_rate=lr)
    grad_of = nn.value_and_grad(model, default_loss)
    batch_size = sum(rows)
    bounds = [sum(rows[:i]) for i in range(len(rows) + 1)]
    parts = list(zip(bounds, bounds[1:], strict=False)) if split else []
    batches = iterate_batches(CacheDataset(train_set), batch_size, 2048, loop=True, seed=0)
    out = []
    for _, (batch, lengths) in zip(range(steps), batches, strict=False):
        if not parts:
            _, grad = grad_of(model, batch, lengths)
        else:
            halves = [grad_of(model, batch[a:b], lengths[a:b]) for a, b in parts]
            total = sum(toks for (_, toks), _ in halves)
            flat: dict[str, Any] = {}
            for (_, toks), g in halves:
                for k, v in tree_flatten(g):
                    flat[k] = flat[k] + v * (toks / total) if k in flat else v * (toks / total)
            grad = tree_unflatten(list(flat.items()))
        opt.update(model, grad)
        mx.eval(model.parameters(), opt.state)
        out.append({k: np.array(v) for k, v in tree_flatten(model.trainable_parameters())})
    return out


def worst(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(float(abs(a[k] - b[k]).max()) for k in a)


def mlx_lm_adam(
    model: Path, data: Path, out: Path, lr: float, iters: int, batch: int
) -> dict[str, Any]:
    """`mlx_lm.lora --train` with Adam (train_model, as tests/ranks/test_finetune.py runs it)."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm import load
    from mlx_lm.lora import CONFIG_DEFAULTS, train_model
    from mlx_lm.tuner.datasets import load_dataset

    args = types.SimpleNamespace(
        **{
            **CONFIG_DEFAULTS,
            "model": str(model),
            "data": str(data),
            "train": True,
            "iters": iters,
            "batch_size": batch,
            "num_layers": -1,
            "adapter_path": str(out),
            "optimizer": "adam",
            "learning_rate": lr,
            "seed": 0,
            "steps_per_report": 1,
            "steps_per_eval": 1000,
            "val_batches": 1,
            "save_every": 1000,
        }
    )
    np.random.seed(0)
    loaded, tokenizer = load(str(model))
    train_set, valid_set, _ = load_dataset(args, tokenizer)
    train_model(args, loaded, train_set, valid_set, None)
    return {k: np.array(v) for k, v in mx.load(str(out / "adapters.safetensors")).items()}


def exo_tp_adam(
    model: Path, data: Path, out: Path, lr: float, iters: int, rows: list[int]
) -> dict[str, Any]:
    import mlx.core as mx
    import numpy as np

    subprocess.run(
        [sys.executable, "-m", "exo_tp", "finetune", "--model", str(model), "--data", str(data),
         "--ranks", str(len(rows)), "--weights", ",".join(map(str, rows)), "--iters", str(iters),
         "--batch-size", str(sum(rows)),
         "--num-layers", "-1", "--optimizer", "adam", "--learning-rate", str(lr),
         "--steps-per-eval", "1000", "--val-batches", "1", "--adapter-path", str(out)],
        check=True, cwd=ROOT, capture_output=True,
    )  # fmt: skip
    return {k: np.array(v) for k, v in mx.load(str(out / "adapters.safetensors")).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate (test_finetune's)")
    parser.add_argument("--rows", default="3,1", help="each rank's rows of a batch")
    parser.add_argument(
        "--chat", action="store_true", help="tests/cluster/test_finetune_cluster.py's chat data"
    )
    parser.add_argument("--exo-tp", action="store_true", help="also exo-tp against mlx-lm")
    parser.add_argument("--quick", action="store_true", help="a smoke run (tiny settings)")
    args = parser.parse_args()
    if args.quick:  # one step takes every path: each step's drift, and adapters to compare
        args.steps, args.exo_tp = 1, True
    sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "cluster")]
    from arch_configs import tiny_config
    from tiny_models import write_tiny_model

    from exo_tp.models.registry import prepare_default_models

    work = Path(tempfile.mkdtemp(prefix="adam-noise-"))
    tokenizer = prepare_default_models()["smollm2-135m"]
    model = write_tiny_model(work / "llama", tiny_config("llama"), tokenizer)
    rows = [int(r) for r in args.rows.split(",")]
    if args.chat:
        from test_finetune_cluster import EXAMPLES, VALID, chat_lines

        data = work / "data"
        data.mkdir()
        (data / "train.jsonl").write_text(chat_lines(EXAMPLES, 0))
        (data / "valid.jsonl").write_text(chat_lines(VALID, 1))
    else:
        data = write_data(work / "data")
    result: dict[str, Any] = {"lr": args.lr}
    for optimizer in ("sgd", "adam"):
        whole = lora_run(model, data, optimizer, args.lr, args.steps, rows, split=False)
        split = lora_run(model, data, optimizer, args.lr, args.steps, rows, split=True)
        drift = [worst(a, b) for a, b in zip(whole, split, strict=True)]
        scale = max(float(abs(v).max()) for v in whole[-1].values())
        result[optimizer] = {"drift": drift, "max_weight": scale}
        print(
            f"{optimizer}: max |whole - split| per step "
            + " ".join(f"{d:.1e}" for d in drift)
            + f" (max |weight| {scale:.3f})"
        )
    if args.exo_tp:
        result["exo_tp_adam"] = {}
        for iters in [args.steps] if args.quick else sorted({1, 3, args.steps}):
            ref = mlx_lm_adam(model, data, work / f"ref-{iters}", args.lr, iters, sum(rows))
            ours = exo_tp_adam(model, data, work / f"exo-{iters}", args.lr, iters, rows)
            result["exo_tp_adam"][iters] = worst(ours, ref)
            print(f"exo-tp {args.rows} vs mlx_lm.lora, Adam, {iters} steps: {worst(ours, ref):.1e}")
    if args.quick:
        shutil.rmtree(work)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
