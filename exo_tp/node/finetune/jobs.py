"""Fine-tuning behind OpenAI's API, on the cluster's own nodes (the leader runs the jobs).

The API's files and jobs live on disk (`exo_tp.finetune.state`). Every input is checked before
a job starts: each JSONL line at upload, then the request (`exo_tp.node.finetune.requests`: the
number of examples against the batch, the base model, known to the cluster and dense). A job
then runs on the leader's cluster, one job at a time (what it leaves in its state, events and
results: `exo_tp.node.finetune.records`):

1. the leader stops serving (requests get a 503 with Retry-After and the job's progress) and
   lets every serving rank go;
2. it plans the cut with the fine-tuning planner (`plan_finetune`: base rows by each node's
   available memory, batch rows by its measured speed) over the alive members, itself rank 0;
3. it sends each node a `FinetuneAssign` over the signed control channel: the job, the ring's
   addresses, the training data, and the node's part of a weights transfer planned for the
   job's rows (`finetune_boxes`, `plan_shares`): a node keeps what it holds and fetches only
   the rest;
4. each node starts its rank under its worker's supervision (`FinetuneRanks`); the leader
   follows rank 0's loss reports (events) and every node's status: a rank that fails, or a
   node that stops answering for `DEAD_AFTER` seconds, fails the job; cancel stops every rank;
5. every rank writes the adapter on its own node; the job's result is the model
   ``ft:<base>:<suffix>:<job id>``, served by the base with that adapter on every rank's
   shard, and the adapter files are result files of the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp

from exo_tp.api.core.errors import ApiError
from exo_tp.errors import ExoTpError
from exo_tp.finetune.data import DataError, check_jsonl
from exo_tp.finetune.openai_schema import (
    FINISHED,
    Checkpoint,
    CreateJob,
    FileObject,
    Job,
    JobError,
    JobEvent,
    Progress,
)
from exo_tp.finetune.state import FineTuneState
from exo_tp.node.cluster.control import ControlClient
from exo_tp.node.cluster.finetune_messages import (
    FinetuneAccepted,
    FinetuneAssign,
    FinetuneStop,
    FinetuneStopped,
)
from exo_tp.node.finetune.orders import base_orders
from exo_tp.node.finetune.ranks import FinetuneRanks
from exo_tp.node.finetune.records import FT_PREFIX, add_event, record_report, record_results
from exo_tp.node.finetune.requests import JoinedSource, new_job
from exo_tp.node.finetune.settings import job_settings
from exo_tp.node.leader.members import node_weights
from exo_tp.plan.finetune import plan_finetune
from exo_tp.wire.announcement import Announcement
from exo_tp.wire.errors import PeerRefused
from exo_tp.wire.http import SignedClient
from exo_tp.wire.ids import Epoch, NodeId
from exo_tp.wire.profiles import ProfileSummary

if TYPE_CHECKING:
    from exo_tp.node.joined import Joined

log = logging.getLogger(__name__)

DEAD_AFTER = 4.0  # seconds without a status: the node is gone (the job fails)
WATCH_SECONDS = 0.5


def not_found(what: str, ident: str, param: str | None = None) -> ApiError:
    return ApiError(
        404, f"No such {what}: '{ident[:200]}'", param=param, code=f"{what.replace(' ', '_')}"
        "_not_found"
    )  # fmt: skip


@dataclass
class Running:
    job_id: str
    nodes: tuple[NodeId, ...]
    task: asyncio.Task[None] | None = None
    cancelled: bool = False


class FineTuning:
    def __init__(
        self,
        node_id: NodeId,
        secret: str,
        state: FineTuneState,
        ranks: FinetuneRanks,
        views: JoinedSource,
        control: ControlClient,
    ):
        self.node_id, self.state, self.ranks, self._views = node_id, state, ranks, views
        self._control = control
        self._client = SignedClient(secret)
        self.running: Running | None = None
        self._creating = asyncio.Lock()  # two requests at once: one job, one 429

    # ---- files -----------------------------------------------------------------------------

    def upload(self, filename: str, raw: bytes, purpose: str) -> FileObject:
        if purpose != "fine-tune":
            raise ApiError(
                400,
                f"Invalid value for 'purpose': '{purpose[:50]}'; this server accepts "
                "'fine-tune' files",
                param="purpose",
            )
        try:
            fmt, examples = check_jsonl(raw)
        except DataError as error:
            raise ApiError(
                400, f"Invalid file '{filename[:200]}': {error}", param="file", code="invalid_file"
            ) from None
        return self.state.add_file(filename, raw, "fine-tune", examples, fmt)

    def files(self) -> list[FileObject]:
        return sorted(self.state.files.values(), key=lambda f: (-f.created_at, f.id))

    def file(self, file_id: str) -> FileObject:
        file = self.state.files.get(file_id)
        if file is None:
            raise not_found("file", file_id, "file_id")
        return file

    def content(self, file_id: str) -> bytes:
        self.file(file_id)
        return self.state.data_path(file_id).read_bytes()

    def delete(self, file_id: str) -> None:
        self.file(file_id)
        self.state.delete_file(file_id)

    # ---- jobs: what the API asks -----------------------------------------------------------

    def job(self, job_id: str) -> Job:
        job = self.state.jobs.get(job_id)
        if job is None:
            raise not_found("fine-tuning job", job_id, "fine_tuning_job_id")
        return job

    def events(self, job_id: str) -> list[JobEvent]:
        self.job(job_id)
        return self.state.events(job_id)

    def checkpoints(self, job_id: str) -> list[Checkpoint]:
        self.job(job_id)
        return self.state.checkpoints(job_id)

    def adapter_file(self, job_id: str, name: str) -> bytes:
        job = self.job(job_id)
        path = self.state.adapter_dir(job_id) / name
        if job.status != "succeeded" or not path.is_file():
            raise ApiError(404, f"job {job_id} has no adapter ({job.status})", code="not_found")
        return path.read_bytes()

    def jobs(self) -> list[Job]:
        return sorted(self.state.jobs.values(), key=lambda j: (-j.created_at, j.id))

    async def create(self, body: CreateJob) -> Job:
        async with self._creating:  # the checks await the model's config
            return await self._create(body)

    async def _create(self, body: CreateJob) -> Job:
        if self.running is not None:
            raise ApiError(
                429,
                f"the cluster is running fine-tuning job {self.running.job_id}; "
                "one job runs at a time: retry once it ends",
                kind="server_error",
                code="job_running",
                retry_after=30,
            )
        job = await new_job(body, self.state, self._views)
        self.state.save_job(job)
        add_event(self.state, job.id, f"Created fine-tuning job: {job.id}")
        self.running = Running(job_id=job.id, nodes=())
        self.running.task = asyncio.create_task(self._run(job.id), name=f"finetune-{job.id}")
        return job

    async def cancel(self, job_id: str) -> Job:
        job = self.job(job_id)
        running = self.running
        if job.status in FINISHED or running is None or running.job_id != job_id:
            raise ApiError(
                400, f"Job {job_id} has already {job.status}: it cannot be cancelled"
                if job.status in FINISHED else f"Job {job_id} is not running", code="invalid_state"
            )  # fmt: skip
        running.cancelled = True
        if running.task is not None:
            running.task.cancel()
            await asyncio.gather(running.task, return_exceptions=True)
        return self.job(job_id)

    # ---- the fine-tuned models -------------------------------------------------------------

    def models(self) -> list[tuple[str, Job]]:
        return [(j.fine_tuned_model, j) for j in self.jobs() if j.fine_tuned_model]

    def adapter_of(self, name: str) -> Job | None:
        """The succeeded job whose model is ``name`` (``ft:...``)."""
        if not name.startswith(FT_PREFIX):
            return None
        return next((j for n, j in self.models() if n == name), None)

    def busy_error(self) -> ApiError | None:
        """The 503 a generation request gets while a job trains."""
        running = self.running
        if running is None:
            return None
        job = self.state.jobs.get(running.job_id)
        p = job.progress if job else Progress()
        loss = f", train loss {p.train_loss:.4f}" if p.train_loss is not None else ""
        return ApiError(
            503,
            f"the cluster is fine-tuning (job {running.job_id}: step {p.step} of "
            f"{p.total_steps}{loss}); generation resumes when it ends",
            kind="server_error",
            code="fine_tuning",
            retry_after=10,
        )

    # ---- running a job ---------------------------------------------------------------------

    async def _run(self, job_id: str) -> None:
        joined = self._views.joined
        assert joined is not None and self.running is not None
        leader = joined.leader
        error: JobError | None = None
        status = "succeeded"
        try:
            await leader.pause(f"fine-tuning job {job_id} is starting")
            await self._train(job_id)
        except asyncio.CancelledError:
            status = "cancelled"
        except (ExoTpError, aiohttp.ClientError, TimeoutError, OSError, PeerRefused) as failure:
            status = "failed"
            message = str(failure) or type(failure).__name__
            error = JobError(code="training_failed", message=message)
        except Exception as failure:
            log.exception("fine-tuning %s", job_id)
            status = "failed"
            error = JobError(code="internal_error", message=f"{type(failure).__name__}: {failure}")
        finally:
            nodes = self.running.nodes if self.running else ()
            await self._stop_all(job_id, nodes)
            self.state.remove_job_data(job_id)
            if status == "succeeded":
                record_results(self.state, job_id)
            self.state.finish(job_id, status, error)
            if error is not None:
                log.warning("fine-tuning %s failed: %s", job_id, error.message)
            else:
                log.info("fine-tuning %s %s", job_id, status)
            self.running = None
            leader.resume()

    def _members(self) -> list[Announcement]:
        joined = self._views.joined
        assert joined is not None
        alive = joined.peers.alive()
        return sorted(alive, key=lambda a: (a.node_id != self.node_id, a.node_id))

    async def _train(self, job_id: str) -> None:
        joined = self._views.joined
        assert joined is not None and self.running is not None
        job = self.job(job_id)
        members = self._members()
        ids = tuple(m.node_id for m in members)
        self.running.nodes = ids
        key = joined.models.key_of(job.model)
        if key is None:
            raise ExoTpError(f"no member has the model {job.model} any more")
        model = await joined.models.prepare(key, ids)
        profiles: dict[NodeId, ProfileSummary | None] = {}
        memory: list[float] = []
        for member in members:
            status = joined.peers.status(member.node_id)
            profiles[member.node_id] = status.profile if status else None
            available = status.memory.available if status else None
            memory.append(float(available or member.memory_available or 1))
        speeds = node_weights(members, profiles, model.spec)
        plan = plan_finetune(memory, speeds, job.hyperparameters.batch_size)
        orders = await base_orders(joined.models, model, members, plan)
        ports = await asyncio.gather(*(self._control.ports(m, Epoch(0)) for m in members))
        hostfile = tuple(f"{m.host}:{p.ring}" for m, p in zip(members, ports, strict=True))
        settings = job_settings(job, plan)
        train = self.state.data_path(job.training_file).read_text()
        valid = self.state.data_path(job.validation_file).read_text() if job.validation_file else ""
        self.state.update(job_id, status="running", nodes=ids)
        add_event(
            self.state,
            job_id,
            f"Fine-tuning on {len(ids)} nodes ({', '.join(ids)}): base rows by memory "
            f"{[round(w / sum(memory), 3) for w in memory]}, batch rows "
            f"{[s.size for s in plan.batch]} of {plan.batch_size}",
        )
        await asyncio.gather(
            *(
                self._client.call(
                    m.control_url,
                    "/finetune/assign",
                    FinetuneAssign(
                        job_id=job_id,
                        leader=self.node_id,
                        rank=rank,
                        hostfile=hostfile,
                        job=settings,
                        train=train,
                        valid=valid,
                        weights=orders[m.node_id],
                    ),
                    FinetuneAccepted,
                )
                for rank, m in enumerate(members)
            )
        )
        await self._watch(job_id, ids)

    def _gone(self, joined: Joined, nodes: tuple[NodeId, ...]) -> list[NodeId]:
        """The job's other nodes with no status for DEAD_AFTER seconds."""
        return [
            n
            for n in nodes
            if n != self.node_id and joined.peers.status(n, max_age=DEAD_AFTER) is None
        ]

    async def _watch(self, job_id: str, nodes: tuple[NodeId, ...]) -> None:
        """Until every rank is done; raises on the first failure (naming a node that stopped
        answering before a rank that lost its ring)."""
        joined = self._views.joined
        assert joined is not None
        seen = 0
        while True:
            self.ranks.changed.clear()
            reports = self.ranks.reports
            for report in reports[seen:]:
                record_report(self.state, job_id, report)
            seen = len(reports)
            gone = self._gone(joined, nodes)
            if gone:
                raise ExoTpError(
                    f"node {', '.join(gone)} stopped answering during training (no status for "
                    f"{DEAD_AFTER:g} s); the job's other ranks were stopped"
                )
            states = {}
            for n in nodes:
                status = joined.peers.status(n)
                rank = status.finetune if status else None
                if rank is not None and rank.job_id == job_id:
                    states[n] = rank
            failed = [r for r in states.values() if r.state == "failed"]
            if failed:
                await self._name_the_dead(nodes)  # a dead node explains a lost ring best
                raise ExoTpError(failed[0].error or "a rank failed")
            if len(states) == len(nodes) and all(r.state == "done" for r in states.values()):
                done = self.ranks.done
                if done is not None and done.report.steps:
                    last = done.report.steps[-1]
                    self.state.update(job_id, trained_tokens=last.trained_tokens)
                fetched = {n: r.fetched_bytes for n, r in states.items()}
                peaks = {n: r.peak_memory for n, r in states.items()}
                self.state.update(job_id, fetched_bytes=fetched, peak_memory=peaks)
                add_event(
                    self.state,
                    job_id,
                    "Bytes of base rows each node fetched: "
                    + ", ".join(f"{n} {b}" for n, b in fetched.items()),
                )
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.ranks.changed.wait(), WATCH_SECONDS)

    async def _name_the_dead(self, nodes: tuple[NodeId, ...]) -> None:
        """Raise naming a node that stopped answering, if one did (a rank whose ring broke
        fails at once; its peer's status goes stale within DEAD_AFTER)."""
        joined = self._views.joined
        assert joined is not None
        deadline = time.monotonic() + DEAD_AFTER + 1.0
        while time.monotonic() < deadline:
            gone = self._gone(joined, nodes)
            if gone:
                raise ExoTpError(
                    f"node {', '.join(gone)} stopped answering during training; the job's "
                    "other ranks were stopped"
                )
            await asyncio.sleep(0.25)

    async def _stop_all(self, job_id: str, nodes: tuple[NodeId, ...]) -> None:
        joined = self._views.joined
        if joined is None:
            return
        peers = [joined.peers.get(n) for n in nodes]

        async def stop(peer: Announcement) -> None:
            try:
                await asyncio.wait_for(
                    self._client.call(peer.control_url, "/finetune/stop",
                                      FinetuneStop(job_id=job_id), FinetuneStopped), 5.0
                )  # fmt: skip
            except (aiohttp.ClientError, TimeoutError, OSError, PeerRefused) as error:
                log.info("fine-tuning %s: stopping on %s: %s", job_id, peer.node_id, error)

        await asyncio.gather(*(stop(p) for p in peers if p is not None))

    async def close(self) -> None:
        running = self.running
        if running is not None and running.task is not None:
            running.cancelled = True
            running.task.cancel()
            await asyncio.gather(running.task, return_exceptions=True)
        await self._client.close()
