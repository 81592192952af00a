"""What every rank of a fine-tuning job is told, and what each reports back (pure: no MLX)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, TypeAdapter

from exo_tp.frozen import Frozen
from exo_tp.plan.finetune import FinetunePlan
from exo_tp.plan.shard_plan import Span
from exo_tp.process.messages import ChildHeartbeat, ChildResult, Failed, Hello, Ready

RANK_ENV = "EXO_TP_FINETUNE_RANK"

Optimizer = Literal["adam", "adamw", "sgd", "adafactor"]


class LoraSettings(Frozen):
    """mlx-lm's LoRA parameters (`lora_parameters` of its adapter_config.json)."""

    rank: int = Field(default=8, ge=1)
    scale: float = 20.0
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    # LoRA on the last ``num_layers`` blocks (-1: all), as mlx_lm.lora --num-layers
    num_layers: int = Field(default=16, ge=-1)


class FinetuneJob(Frozen):
    model_dir: str
    data_dir: str
    adapter_path: str  # folder: adapters.safetensors + adapter_config.json, as mlx_lm.lora
    plan: FinetunePlan
    lora: LoraSettings = LoraSettings()
    iters: int = Field(default=1000, ge=1)
    learning_rate: float = Field(default=1e-5, gt=0)
    optimizer: Optimizer = "adam"
    seed: int = 0
    max_seq_length: int = Field(default=2048, ge=2)
    mask_prompt: bool = False
    steps_per_report: int = Field(default=10, ge=1)
    steps_per_eval: int = Field(default=200, ge=1)
    val_batches: int = Field(default=25, ge=-1)
    save_every: int = Field(default=100, ge=1)
    # Gather the next step's weights while this one computes (off: gather when needed).
    prefetch: bool = True
    # Every rank writes the adapter (its LoRA weights are replicated), not rank 0 alone: on a
    # cluster each node then serves it from its own disk.
    save_on_every_rank: bool = False


# A diverged run reports NaN losses: written as NaN (JSON's null would not read back).
_LOSSES = ConfigDict(frozen=True, extra="forbid", ser_json_inf_nan="constants")


class StepReport(Frozen):
    """One training-loss report of mlx-lm's trainer (every ``steps_per_report`` steps)."""

    model_config = _LOSSES

    iteration: int
    train_loss: float
    learning_rate: float
    tokens_per_second: float  # all ranks' tokens over this rank's training time
    trained_tokens: int  # all ranks' tokens so far
    seconds: float  # training time of the steps since the previous report


class ValReport(Frozen):
    model_config = _LOSSES

    iteration: int
    val_loss: float


class RankReport(Frozen):
    rank: int
    batch_rows: Span  # this rank's rows of every global batch
    base_bytes: int  # the whole base model as stored
    held_bytes: int  # the base weights this rank holds (its row shards and replicated norms)
    lora_bytes: int  # the LoRA parameters (replicated)
    load_peak: int  # peak memory after loading
    train_peak: int  # peak memory while training (loading excluded)
    steps: tuple[StepReport, ...]
    val: tuple[ValReport, ...]


class RankProgress(ChildHeartbeat):
    """A loss report while training (a heartbeat: it proves the rank is alive too)."""

    model_config = _LOSSES

    kind: Literal["progress"] = "progress"
    train: StepReport | None = None
    val: ValReport | None = None


class RankDone(ChildResult):
    """A rank's last message to its supervisor (`exo_tp.process`): its report. Before it,
    the plain Hello, Ready once it joined the ring, or Failed."""

    kind: Literal["result"] = "result"
    report: RankReport


RankEvent = Annotated[Hello | Ready | Failed | RankProgress | RankDone, Field(discriminator="kind")]
RANK_EVENTS: TypeAdapter[Hello | Ready | Failed | RankProgress | RankDone] = TypeAdapter(RankEvent)


class FinetuneReport(Frozen):
    """What `exo-tp finetune --report-out` writes: the job and every rank's report."""

    job: FinetuneJob
    ranks: tuple[RankReport, ...]
