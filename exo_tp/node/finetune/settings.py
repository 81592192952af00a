"""A fine-tuning job's training settings, as every rank runs them, from the OpenAI-style job a
client created and the plan of its rows (pure)."""

from __future__ import annotations

from exo_tp.finetune.openai_schema import Job
from exo_tp.plan.finetune import FinetunePlan
from exo_tp.wire.finetune_job import FinetuneJob, LoraSettings

BASE_LEARNING_RATE = 1e-5  # mlx_lm.lora's default; OpenAI's multiplier scales it


def job_settings(job: Job, plan: FinetunePlan) -> FinetuneJob:
    """The ranks' FinetuneJob (the folders are each rank's own: left empty here)."""
    iters = job.iterations
    return FinetuneJob(
        model_dir="",
        data_dir="",
        adapter_path="",
        plan=plan,
        lora=LoraSettings(
            rank=job.lora.rank, scale=job.lora.scale, num_layers=job.lora.layers or -1
        ),
        iters=iters,
        learning_rate=BASE_LEARNING_RATE * job.hyperparameters.learning_rate_multiplier,
        optimizer=job.hyperparameters.optimizer,
        seed=job.seed,
        steps_per_report=1,
        steps_per_eval=max(1, iters // 4),
        val_batches=-1,
        save_every=iters,
        save_on_every_rank=True,
    )
