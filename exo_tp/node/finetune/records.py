"""What a fine-tuning job leaves in its state: events, progress, and a succeeded job's results
(its adapter files as result files, the model ``ft:<base>:<suffix>:<job id>``, a checkpoint)."""

from __future__ import annotations

import time

from exo_tp.finetune.openai_schema import Checkpoint, CheckpointMetrics, EventData, JobEvent
from exo_tp.finetune.state import ADAPTER_FILES, FineTuneState, new_id
from exo_tp.frozen import replace
from exo_tp.wire.finetune_job import StepReport, ValReport

FT_PREFIX = "ft:"


def add_event(
    state: FineTuneState,
    job_id: str,
    message: str,
    level: str = "info",
    data: EventData | None = None,
) -> None:
    state.add_event(
        job_id,
        JobEvent(
            id=new_id("ftevent"),
            created_at=int(time.time()),
            level=level,  # type: ignore[arg-type]
            message=message,
            type="metrics" if data else "message",
            data=data,
        ),
    )


def record_report(state: FineTuneState, job_id: str, report: StepReport | ValReport) -> None:
    """A rank 0 loss report as the job's progress and a metrics event."""
    job = state.jobs[job_id]
    if isinstance(report, StepReport):
        data = EventData(
            step=report.iteration,
            train_loss=report.train_loss,
            learning_rate=report.learning_rate,
            tokens_per_second=report.tokens_per_second,
        )
        message = f"Step {report.iteration}/{job.iterations}: training loss={report.train_loss:.4f}"
        progress = replace(job.progress, step=report.iteration, train_loss=report.train_loss)
    else:
        data = EventData(step=report.iteration, valid_loss=report.val_loss)
        message = f"Step {report.iteration}/{job.iterations}: validation loss={report.val_loss:.4f}"
        progress = replace(job.progress, val_loss=report.val_loss)
    state.update(job_id, progress=progress)
    add_event(state, job_id, message, data=data)


def record_results(state: FineTuneState, job_id: str) -> None:
    """A succeeded job's adapter files as result files, its model name and its one
    checkpoint."""
    job = state.jobs[job_id]
    adapter = state.adapter_dir(job_id)
    results = []
    for name in ADAPTER_FILES:
        path = adapter / name
        if path.is_file():
            raw = path.read_bytes()
            file = state.add_file(f"{job_id}-{name}", raw, "fine-tune-results", 0, "adapter")
            results.append(file.id)
    suffix = job.suffix or "exo-tp"
    name = f"{FT_PREFIX}{job.model}:{suffix}:{job_id}"
    state.update(job_id, fine_tuned_model=name, result_files=tuple(results))
    last = job.progress
    state.add_checkpoint(
        job_id,
        Checkpoint(
            id=new_id("ftckpt"),
            created_at=int(time.time()),
            fine_tuned_model_checkpoint=name,
            fine_tuning_job_id=job_id,
            metrics=CheckpointMetrics(
                step=last.step, train_loss=last.train_loss, valid_loss=last.val_loss
            ),
            step_number=last.step,
        ),
    )
