"""One rank's training: mlx-lm's trainer over the sharded model, with two small differences.

`mlx_lm.tuner.trainer.train` is used as is (its compiled step, optimizer update, gradient
all-reduce, validation, reports and adapter saving). What differs is passed in through its own
hooks:

- ``iterate_batches``: every rank draws the same global batches as a single device would
  (mlx-lm's own iterate_batches, same seed) and keeps its rows of each, in proportion to its
  speed; mlx-lm would give every rank an equal strided part.
- ``loss``: mlx-lm averages gradients over ranks with equal weights, which is the single-device
  gradient only when every rank has as many tokens. With uneven micro-batches each rank's mean
  loss is rescaled by ``N * local tokens / all tokens``, so the equal-weight average becomes
  the token-weighted one: exactly the gradient of the whole batch's mean loss. Its value
  averaged over ranks (mlx-lm's report) is the whole batch's mean loss too. In evaluation the
  plain local mean is returned, since mlx-lm's evaluate weights by tokens itself.
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.tuner.callbacks import TrainingCallback
from mlx_lm.tuner.datasets import CacheDataset, load_dataset
from mlx_lm.tuner.trainer import TrainingArgs, default_loss, iterate_batches, train
from mlx_lm.utils import save_config

from exo_tp.errors import ExoTpError
from exo_tp.finetune.gather import GatherChain
from exo_tp.finetune.model import build_model, lora_parameters
from exo_tp.models.tokenizer import load_model_tokenizer
from exo_tp.plan.shard_plan import Span
from exo_tp.wire.finetune_job import FinetuneJob, RankReport, StepReport, ValReport

log = logging.getLogger("exo_tp.finetune")

OPTIMIZERS = {
    "adam": optim.Adam,
    "adamw": optim.AdamW,
    "sgd": optim.SGD,
    "adafactor": optim.Adafactor,
}


def rank_batches(
    dataset: Any,
    batch_size: int,
    max_seq_length: int,
    loop: bool = False,
    seed: int | None = None,
    comm_group: Any = None,
    *,
    rows: Span,
) -> Iterator[tuple[mx.array, mx.array]]:
    """This rank's rows of the batches a single device would train on."""
    for batch, lengths in iterate_batches(
        dataset, batch_size, max_seq_length, loop=loop, seed=seed
    ):
        yield batch[rows.start : rows.stop], lengths[rows.start : rows.stop]


def token_weighted_loss(
    model: nn.Module, batch: mx.array, lengths: mx.array, *, chain: GatherChain
) -> tuple[mx.array, mx.array]:
    mean, tokens = default_loss(model, batch, lengths)
    n = chain.group.size()
    if not model.training or n == 1:
        return mean, tokens
    local = mx.stop_gradient(tokens.astype(mx.float32)).reshape(1)
    # Through the chain: ordered after the forward's gathers, before the backward's.
    (counts,) = chain.all_gather([local], [1] * n, [(n,)], tie=local)
    total = mx.stop_gradient(counts.sum())  # a count: no gradient (and none through the tie)
    return mean * local[0] * (n / total), tokens


class ReportCallback(TrainingCallback):
    """Keeps mlx-lm's loss reports for the rank's report (and passes each on, as it comes, to
    ``on_report``: the worker's supervisor follows a job's progress)."""

    def __init__(self, on_report: Callable[[StepReport | ValReport], None] | None = None):
        self.on_report = on_report
        self.steps: list[StepReport] = []
        self.val: list[ValReport] = []
        self._tokens = 0

    def on_train_loss_report(self, info: dict[str, Any]) -> None:
        tokens = int(info["trained_tokens"])
        window = tokens - self._tokens
        self._tokens = tokens
        speed = float(info["tokens_per_second"])
        report = StepReport(
            iteration=int(info["iteration"]),
            train_loss=float(info["train_loss"]),
            learning_rate=float(info["learning_rate"]),
            tokens_per_second=speed,
            trained_tokens=tokens,
            seconds=window / speed if speed > 0 else 0.0,
        )
        self.steps.append(report)
        if self.on_report is not None:
            self.on_report(report)

    def on_val_loss_report(self, info: dict[str, Any]) -> None:
        report = ValReport(iteration=int(info["iteration"]), val_loss=float(info["val_loss"]))
        self.val.append(report)
        if self.on_report is not None:
            self.on_report(report)


def _datasets(job: FinetuneJob, tokenizer: Any) -> tuple[Any, Any]:
    data = Path(job.data_dir)
    if not (data / "train.jsonl").is_file():  # never let mlx-lm try a hub dataset instead
        raise ExoTpError(
            f"{data} has no train.jsonl (mlx_lm.lora's data format: "
            f"train.jsonl and valid.jsonl, one JSON object per line)"
        )
    args = types.SimpleNamespace(
        data=str(data), train=True, test=False, mask_prompt=job.mask_prompt
    )
    try:
        train_set, valid_set, _ = load_dataset(args, tokenizer)
    except (ValueError, KeyError) as error:
        raise ExoTpError(f"cannot read the data in {data}: {error}") from None
    if len(train_set) < job.plan.batch_size:
        raise ExoTpError(
            f"{data}/train.jsonl has {len(train_set)} examples, fewer than "
            f"--batch-size {job.plan.batch_size}"
        )
    if len(valid_set) and len(valid_set) < job.plan.batch_size:
        raise ExoTpError(
            f"{data}/valid.jsonl has {len(valid_set)} examples, fewer than "
            f"--batch-size {job.plan.batch_size}"
        )
    return train_set, valid_set


def adapter_config(job: FinetuneJob) -> dict[str, Any]:
    """adapter_config.json as mlx_lm.lora writes it (what mlx_lm's load_adapters reads)."""
    return {
        "model": job.model_dir,
        "data": job.data_dir,
        "fine_tune_type": "lora",
        "num_layers": job.lora.num_layers,
        "lora_parameters": lora_parameters(job.lora),
        "batch_size": job.plan.batch_size,
        "iters": job.iters,
        "learning_rate": job.learning_rate,
        "optimizer": job.optimizer,
        "seed": job.seed,
        "max_seq_length": job.max_seq_length,
        "mask_prompt": job.mask_prompt,
        "adapter_path": job.adapter_path,
        "train": True,
    }


def run_rank(
    job: FinetuneJob,
    rank: int,
    group: mx.distributed.Group,
    on_report: Callable[[StepReport | ValReport], None] | None = None,
) -> RankReport:
    started = time.perf_counter()
    np.random.seed(job.seed)  # mlx_lm.lora seeds numpy first: it orders the batches
    model_dir = Path(job.model_dir)
    tokenizer = load_model_tokenizer(model_dir)
    train_set, valid_set = _datasets(job, tokenizer)
    chain = GatherChain(group, job.prefetch)
    model, footprint = build_model(model_dir, job.lora, job.seed, job.plan, rank, chain)
    chain.record(lambda: model(mx.zeros((1, 1), dtype=mx.int32)))
    load_peak = mx.get_peak_memory()
    log.info(
        "holds %.1f of %.1f MB of base weights (+%.2f MB LoRA), batch rows %d-%d; ready in %.1fs",
        footprint.held_bytes / 1e6,
        footprint.base_bytes / 1e6,
        footprint.lora_bytes / 1e6,
        job.plan.batch[rank].start,
        job.plan.batch[rank].stop,
        time.perf_counter() - started,
    )
    adapters = Path(job.adapter_path)
    if rank == 0 or job.save_on_every_rank:
        adapters.mkdir(parents=True, exist_ok=True)
        save_config(adapter_config(job), adapters / "adapter_config.json")
    rows = job.plan.batch[rank]
    callback = ReportCallback(on_report)
    mx.reset_peak_memory()
    train(
        model=model,
        optimizer=OPTIMIZERS[job.optimizer](learning_rate=job.learning_rate),
        train_dataset=CacheDataset(train_set),
        val_dataset=CacheDataset(valid_set) if len(valid_set) else None,
        args=TrainingArgs(
            batch_size=job.plan.batch_size,
            iters=job.iters,
            val_batches=job.val_batches,
            steps_per_report=job.steps_per_report,
            steps_per_eval=job.steps_per_eval,
            steps_per_save=job.save_every,
            max_seq_length=job.max_seq_length,
            adapter_file=str(adapters / "adapters.safetensors"),
        ),
        loss=partial(token_weighted_loss, chain=chain),
        iterate_batches=partial(rank_batches, rows=rows),
        training_callback=callback,
    )
    if rank != 0 and job.save_on_every_rank:  # mlx-lm's trainer saves on rank 0 only
        weights = dict(tree_flatten(model.trainable_parameters()))
        mx.save_safetensors(str(adapters / "adapters.safetensors"), weights)
    return RankReport(
        rank=rank,
        batch_rows=rows,
        base_bytes=footprint.base_bytes,
        held_bytes=footprint.held_bytes,
        lora_bytes=footprint.lora_bytes,
        load_peak=load_peak,
        train_peak=mx.get_peak_memory(),
        steps=tuple(callback.steps),
        val=tuple(callback.val),
    )
