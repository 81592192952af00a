"""Fine-tuning files and jobs on disk, under ``<exo-tp home>/finetune/<node id>/`` (pure: no MLX).

- ``files/<id>.json`` (the FileObject) beside ``files/<id>.data`` (its bytes);
- ``jobs/<id>/job.json`` (the Job), ``jobs/<id>/events.jsonl`` (one JobEvent a line, appended),
  ``jobs/<id>/checkpoints.jsonl``, ``jobs/<id>/data/`` (train.jsonl and valid.jsonl as
  mlx_lm.lora reads them) and ``jobs/<id>/adapter/`` (adapters.safetensors and
  adapter_config.json, what mlx_lm.lora writes).

Every write goes to a temporary name first and is renamed into place, so a node killed in the
middle leaves the old version or the new one. A node that restarts reads it all back; a job it
was running then is failed (its ranks died with it).
"""

from __future__ import annotations

import logging
import secrets
import shutil
import time
from pathlib import Path

from pydantic import ValidationError

from exo_tp.atomic_file import write_atomically
from exo_tp.finetune.openai_schema import (
    FINISHED,
    Checkpoint,
    EventLevel,
    FileObject,
    FilePurpose,
    Job,
    JobError,
    JobEvent,
)
from exo_tp.frozen import replace
from exo_tp.paths import cache_home

log = logging.getLogger(__name__)

ADAPTER_FILES = ("adapters.safetensors", "adapter_config.json")


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def _write(path: Path, data: bytes) -> None:
    # the folder made on first use: a node that never fine-tunes writes nothing under its home
    write_atomically(path, data)


def state_root(node_id: str) -> Path:
    return cache_home() / "finetune" / node_id


class FineTuneState:
    def __init__(self, root: Path):
        self.root = root
        self.files_dir, self.jobs_dir = root / "files", root / "jobs"
        self.files: dict[str, FileObject] = {}
        self.jobs: dict[str, Job] = {}
        self._load()

    def _load(self) -> None:
        for meta in sorted(self.files_dir.glob("*.json")):
            try:
                file = FileObject.model_validate_json(meta.read_bytes())
            except (ValidationError, OSError) as error:
                log.warning("fine-tuning: skipping %s: %s", meta, error)
                continue
            if self.data_path(file.id).is_file():
                self.files[file.id] = file
        for record in sorted(self.jobs_dir.glob("*/job.json")):
            try:
                job = Job.model_validate_json(record.read_bytes())
            except (ValidationError, OSError) as error:
                log.warning("fine-tuning: skipping %s: %s", record, error)
                continue
            self.jobs[job.id] = job
            if job.status not in FINISHED:  # its ranks died with the node
                self.finish(
                    job.id,
                    "failed",
                    JobError(code="node_restarted", message="the node restarted during the job"),
                )

    # ---- files -----------------------------------------------------------------------------

    def data_path(self, file_id: str) -> Path:
        return self.files_dir / f"{file_id}.data"

    def add_file(
        self,
        filename: str,
        raw: bytes,
        purpose: FilePurpose,
        examples: int,
        fmt: str,
        file_id: str | None = None,
    ) -> FileObject:
        file = FileObject(
            id=file_id or new_id("file"),
            bytes=len(raw),
            created_at=int(time.time()),
            filename=filename,
            purpose=purpose,
            examples=examples,
            format=fmt,  # type: ignore[arg-type]
        )
        _write(self.data_path(file.id), raw)
        _write(self.files_dir / f"{file.id}.json", file.model_dump_json().encode())
        self.files[file.id] = file
        return file

    def delete_file(self, file_id: str) -> bool:
        if self.files.pop(file_id, None) is None:
            return False
        for path in (self.files_dir / f"{file_id}.json", self.data_path(file_id)):
            path.unlink(missing_ok=True)
        return True

    # ---- jobs ------------------------------------------------------------------------------

    def job_dir(self, job_id: str) -> Path:
        return self.jobs_dir / job_id

    def data_dir(self, job_id: str) -> Path:
        return self.job_dir(job_id) / "data"

    def adapter_dir(self, job_id: str) -> Path:
        return self.job_dir(job_id) / "adapter"

    def save_job(self, job: Job) -> Job:
        folder = self.job_dir(job.id)
        folder.mkdir(parents=True, exist_ok=True)
        _write(folder / "job.json", job.model_dump_json().encode())
        self.jobs[job.id] = job
        return job

    def update(self, job_id: str, **changes: object) -> Job:
        return self.save_job(replace(self.jobs[job_id], **changes))

    def finish(self, job_id: str, status: str, error: JobError | None = None) -> Job:
        job = self.update(job_id, status=status, error=error, finished_at=int(time.time()))
        level: EventLevel = "error" if status == "failed" else "info"
        text = {
            "succeeded": "The job has successfully completed",
            "cancelled": "The job was cancelled",
        }.get(status, f"The job failed: {error.message if error else 'unknown error'}")
        self.add_event(job_id, JobEvent(id=new_id("ftevent"), created_at=int(time.time()),
                                        level=level, message=text))  # fmt: skip
        return job

    def add_event(self, job_id: str, event: JobEvent) -> None:
        with (self.job_dir(job_id) / "events.jsonl").open("a") as out:
            out.write(event.model_dump_json() + "\n")

    def events(self, job_id: str) -> list[JobEvent]:
        """Newest first, as OpenAI lists them."""
        path = self.job_dir(job_id) / "events.jsonl"
        if not path.is_file():
            return []
        lines = path.read_text().splitlines()
        return [JobEvent.model_validate_json(line) for line in reversed(lines) if line]

    def add_checkpoint(self, job_id: str, checkpoint: Checkpoint) -> None:
        with (self.job_dir(job_id) / "checkpoints.jsonl").open("a") as out:
            out.write(checkpoint.model_dump_json() + "\n")

    def checkpoints(self, job_id: str) -> list[Checkpoint]:
        path = self.job_dir(job_id) / "checkpoints.jsonl"
        if not path.is_file():
            return []
        lines = path.read_text().splitlines()
        return [Checkpoint.model_validate_json(line) for line in reversed(lines) if line]

    def remove_job_data(self, job_id: str) -> None:
        """The copy of the training data (the adapter stays)."""
        shutil.rmtree(self.data_dir(job_id), ignore_errors=True)
