"""`exo-tp finetune`: LoRA fine-tuning on N local ranks, the frozen base sharded by rows."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from exo_tp.cli.args import (
    add_model_arg,
    non_negative_float,
    positive_float,
    positive_int,
    weight_list,
)
from exo_tp.errors import ExoTpError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "finetune",
        description=__doc__,
        help="LoRA fine-tuning on N local ranks (base weights sharded, gathered just in time)",
    )
    _add_data_and_ranks(p)
    _add_training(p)
    p.set_defaults(handler=run)


def _add_data_and_ranks(p: argparse.ArgumentParser) -> None:
    """The model, the data, and the ranks' shares."""
    add_model_arg(p)
    p.add_argument(
        "--data",
        required=True,
        help="folder with train.jsonl (and valid.jsonl), as mlx_lm.lora reads it",
    )
    p.add_argument("--ranks", type=positive_int, default=2, help="number of local ranks")
    p.add_argument(
        "--weights",
        type=weight_list,
        help="relative speed and memory of each rank, e.g. 5,3,2 (default: equal): "
        "a rank's share of every batch and of the base weights",
    )
    p.add_argument(
        "--memory-weights",
        type=weight_list,
        help="relative memory of each rank when it differs from its speed: its "
        "share of the base weights (default: --weights)",
    )
    p.add_argument(
        "--profiles",
        help="one `exo-tp bench` profile per rank (a.json,b.json,...): a rank's share of the "
        "base follows its available memory, its share of each batch its prefill FLOP/s "
        "(instead of --weights / --memory-weights)",
    )


def _add_training(p: argparse.ArgumentParser) -> None:
    """mlx_lm.lora's training settings, the adapter's folder, and how ranks run."""
    p.add_argument("--iters", type=positive_int, default=1000, help="training steps")
    p.add_argument(
        "--batch-size", type=positive_int, default=4, help="sequences per step, over all ranks"
    )
    p.add_argument("--lora-rank", type=positive_int, default=8)
    p.add_argument("--lora-scale", type=float, default=20.0)
    p.add_argument(
        "--num-layers",
        type=int,
        default=16,
        help="LoRA on the last N blocks (-1: all), as mlx_lm.lora",
    )
    p.add_argument("--learning-rate", type=positive_float, default=1e-5)
    p.add_argument("--optimizer", choices=("adam", "adamw", "sgd", "adafactor"), default="adam")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seq-length", type=positive_int, default=2048)
    p.add_argument(
        "--mask-prompt",
        action="store_true",
        help="no loss on the prompt (completions and chat data)",
    )
    p.add_argument("--steps-per-report", type=positive_int, default=10)
    p.add_argument("--steps-per-eval", type=positive_int, default=200)
    p.add_argument(
        "--val-batches",
        type=int,
        default=25,
        help="validation batches (-1: the whole validation set)",
    )
    p.add_argument(
        "--save-every", type=positive_int, default=100, help="save the adapter every N steps"
    )
    p.add_argument(
        "--adapter-path",
        default="adapters",
        help="output folder: adapters.safetensors + adapter_config.json "
        "(loads in mlx_lm and in exo-tp launch --adapter-path)",
    )
    p.add_argument(
        "--prefetch",
        choices=("auto", "on", "off"),
        default="auto",
        help="gather the next layer's weights while this one computes, on a thread of its own "
        "(auto: on when this machine has two cores per rank; a rank waiting in a collective "
        "spins its thread, which steals a shared core from compute)",
    )
    p.add_argument(
        "--join-timeout",
        type=non_negative_float,
        default=120.0,
        help="seconds to wait for all ranks to join the ring",
    )
    p.add_argument("--report-out", help="save every rank's report (losses, memory) as JSON")


def run(args: argparse.Namespace) -> int:
    from exo_tp.finetune.launcher import run_local
    from exo_tp.models.registry import resolve_model
    from exo_tp.plan.finetune import plan_finetune
    from exo_tp.wire.finetune_job import FinetuneJob, FinetuneReport, LoraSettings

    if args.profiles:
        if args.weights or args.memory_weights:
            raise ExoTpError("--profiles sets the shares: give it or --weights, not both")
        memory, speeds = _from_profiles(args.profiles, args.ranks)
    else:
        speeds = _per_rank(args.weights, args.ranks, "--weights")
        memory = (
            _per_rank(args.memory_weights, args.ranks, "--memory-weights")
            if args.memory_weights
            else speeds
        )
    if any(w <= 0 for w in (*speeds, *memory)):
        raise ExoTpError(
            "every rank needs a positive weight: a rank with no share of the "
            "batch or of the base would only slow the others down"
        )
    if args.val_batches < -1 or args.val_batches == 0:
        raise ExoTpError("--val-batches must be positive, or -1 for the whole validation set")
    if args.lora_scale <= 0:
        raise ExoTpError("--lora-scale must be positive")
    data = Path(args.data).expanduser()
    if not (data / "train.jsonl").is_file():
        raise ExoTpError(
            f"{data} has no train.jsonl (mlx_lm.lora's data format: train.jsonl "
            f"and valid.jsonl, one JSON object per line)"
        )
    model_dir = resolve_model(args.model)
    job = FinetuneJob(
        model_dir=str(model_dir),
        data_dir=str(data.resolve()),
        adapter_path=str(Path(args.adapter_path).expanduser().resolve()),
        plan=plan_finetune(memory, speeds, args.batch_size),
        lora=LoraSettings(rank=args.lora_rank, scale=args.lora_scale, num_layers=args.num_layers),
        iters=args.iters,
        learning_rate=args.learning_rate,
        optimizer=args.optimizer,
        seed=args.seed,
        max_seq_length=args.max_seq_length,
        mask_prompt=args.mask_prompt,
        steps_per_report=args.steps_per_report,
        steps_per_eval=args.steps_per_eval,
        val_batches=args.val_batches,
        save_every=args.save_every,
        prefetch=_prefetch(args.prefetch, args.ranks),
    )
    reports = run_local(job, join_timeout=args.join_timeout)
    if args.report_out:
        Path(args.report_out).write_text(
            FinetuneReport(job=job, ranks=tuple(reports)).model_dump_json(indent=1)
        )
    last = reports[0].steps[-1] if reports[0].steps else None
    loss = f"; final train loss {last.train_loss:.3f}" if last else ""
    print(f"adapter saved to {job.adapter_path}{loss}")
    return 0


def _from_profiles(text: str, ranks: int) -> tuple[list[float], list[float]]:
    """Memory and speed weights from measured device profiles (one per rank)."""
    from exo_tp.plan.devices import read_profile

    paths = [Path(part) for part in text.split(",") if part]
    if len(paths) != ranks:
        raise ExoTpError(f"--profiles has {len(paths)} files for {ranks} ranks")
    profiles = [read_profile(path) for path in paths]
    return ([float(p.memory_available) for p in profiles], [p.prefill_flops for p in profiles])


def _prefetch(mode: str, ranks: int) -> bool:
    if mode == "auto":
        return (os.cpu_count() or 1) >= 2 * ranks
    return mode == "on"


def _per_rank(values: list[float] | None, ranks: int, flag: str) -> list[float]:
    values = values or [1.0] * ranks
    if len(values) != ranks:
        raise ExoTpError(f"{flag} has {len(values)} values for {ranks} ranks")
    return values
