"""OpenAI's fine-tuning and files API as typed bodies (pure: no MLX, no HTTP).

Requests follow https://platform.openai.com/docs/api-reference/fine-tuning and .../files;
what exo-tp adds is marked as an extension (LoRA rank and layers, iterations instead of epochs).
Responses carry OpenAI's fields so the official SDKs parse them unchanged.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from exo_tp.frozen import Frozen

JobStatus = Literal["validating_files", "queued", "running", "succeeded", "failed", "cancelled"]
FINISHED: tuple[JobStatus, ...] = ("succeeded", "failed", "cancelled")
FilePurpose = Literal["fine-tune", "fine-tune-results"]


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Hyperparameters(Request):
    """OpenAI's hyperparameters; "auto" leaves the choice to the server."""

    n_epochs: int | Literal["auto"] = "auto"
    batch_size: int | Literal["auto"] = "auto"
    learning_rate_multiplier: float | Literal["auto"] = "auto"
    # extension: a number of optimizer steps instead of epochs (mlx_lm.lora --iters)
    n_iters: int | None = Field(default=None, ge=1, le=1_000_000)
    # extension: mlx_lm.lora's --optimizer
    optimizer: Literal["adam", "adamw", "sgd", "adafactor"] | None = None


class Supervised(Request):
    hyperparameters: Hyperparameters | None = None


class Method(Request):
    type: Literal["supervised"]
    supervised: Supervised | None = None


class LoraOptions(Request):
    """Extension: mlx_lm.lora's --num-layers (-1: all; unset: 16, or all of a smaller model)
    and LoRA rank."""

    rank: int = Field(default=8, ge=1, le=512)
    layers: int | None = Field(default=None, ge=-1)
    scale: float = Field(default=20.0, gt=0)


class CreateJob(Request):
    model: str = Field(min_length=1, max_length=300)
    training_file: str = Field(min_length=1, max_length=100)
    validation_file: str | None = Field(default=None, max_length=100)
    hyperparameters: Hyperparameters | None = None
    suffix: str | None = Field(default=None, max_length=64, pattern=r"^[A-Za-z0-9_.-]*$")
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)
    method: Method | None = None
    integrations: list[dict[str, str]] | None = None  # accepted and ignored: none exist here
    metadata: dict[str, str] | None = None
    lora: LoraOptions | None = None  # extension


# ---- responses -------------------------------------------------------------------------------


class FileObject(Frozen):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: FilePurpose
    status: Literal["processed"] = "processed"
    status_details: str | None = None
    # what the file holds: examples (lines) and their format, checked at upload (extension)
    examples: int = 0
    format: Literal["chat", "completions", "text", "adapter"] = "chat"


class FileList(Frozen):
    object: Literal["list"] = "list"
    data: tuple[FileObject, ...]
    has_more: bool = False


class FileDeleted(Frozen):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class JobError(Frozen):
    code: str
    message: str
    param: str | None = None


class JobHyperparameters(Frozen):
    n_epochs: int
    batch_size: int
    learning_rate_multiplier: float
    optimizer: Literal["adam", "adamw", "sgd", "adafactor"] = "adam"  # extension


class JobSupervised(Frozen):
    hyperparameters: JobHyperparameters


class JobMethod(Frozen):
    type: Literal["supervised"] = "supervised"
    supervised: JobSupervised


class Progress(Frozen):
    """Extension: where a running job is."""

    step: int = 0
    total_steps: int = 0
    train_loss: float | None = None
    val_loss: float | None = None


class Job(Frozen):
    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    finished_at: int | None = None
    estimated_finish: int | None = None
    error: JobError | None = None
    fine_tuned_model: str | None = None
    hyperparameters: JobHyperparameters
    method: JobMethod
    model: str
    organization_id: str = "exo-tp"
    result_files: tuple[str, ...] = ()
    seed: int
    status: JobStatus
    trained_tokens: int | None = None
    training_file: str
    validation_file: str | None = None
    suffix: str | None = None
    integrations: tuple[dict[str, str], ...] | None = None
    metadata: dict[str, str] | None = None
    user_provided_suffix: str | None = None
    # extensions
    iterations: int
    lora: LoraOptions
    progress: Progress = Progress()
    nodes: tuple[str, ...] = ()  # one rank per node, rank 0 first
    fetched_bytes: dict[str, int] = {}  # base bytes each node fetched from peers for its rows
    peak_memory: dict[str, int] = {}  # each node's rank's peak memory while training


class JobList(Frozen):
    object: Literal["list"] = "list"
    data: tuple[Job, ...]
    has_more: bool = False


class EventData(Frozen):
    step: int
    train_loss: float | None = None
    valid_loss: float | None = None
    learning_rate: float | None = None
    tokens_per_second: float | None = None


EventLevel = Literal["info", "warn", "error"]


class JobEvent(Frozen):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: EventLevel = "info"
    message: str
    type: Literal["message", "metrics"] = "message"
    data: EventData | None = None


class EventList(Frozen):
    object: Literal["list"] = "list"
    data: tuple[JobEvent, ...]
    has_more: bool = False


class CheckpointMetrics(Frozen):
    step: int
    train_loss: float | None = None
    valid_loss: float | None = None


class Checkpoint(Frozen):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    metrics: CheckpointMetrics
    step_number: int


class CheckpointList(Frozen):
    object: Literal["list"] = "list"
    data: tuple[Checkpoint, ...]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None
