"""This node's rank of a fine-tuning job (the leader's `FinetuneAssign`): the training data
written beside its copy of the job, the base rows it lacks fetched through the weights
transfer, then the rank started by the node's worker supervision (`NodeWorker.start_finetune`)
and followed until it reports or fails. Its state is in the node's status; on the leader (rank
0) the job runner also reads its loss reports from here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from exo_tp.api.http_io import MAX_BODY
from exo_tp.errors import ExoTpError
from exo_tp.finetune.state import FineTuneState
from exo_tp.frozen import replace
from exo_tp.node.cluster.control import ControlRefused
from exo_tp.node.cluster.finetune_messages import (
    FinetuneAccepted,
    FinetuneAssign,
    FineTunedModel,
    FinetuneRankStatus,
    FinetuneStop,
    FinetuneStopped,
    RankState,
)
from exo_tp.node.member.control_handlers import EXPECTED_FETCH_ERRORS
from exo_tp.node.member.weights import NodeWeights
from exo_tp.node.member.worker import NodeWorker
from exo_tp.process.blas import group_threads
from exo_tp.process.events import Exited, Failed, Heartbeat, ProcessEvent
from exo_tp.process.supervisor import Child, Job, clean_environment
from exo_tp.transport.ring import ring_env, write_hostfile
from exo_tp.wire.finetune_job import RANK_ENV, RankDone, RankProgress, StepReport, ValReport
from exo_tp.wire.http import post, signed_app
from exo_tp.wire.ids import Epoch, NodeId

log = logging.getLogger(__name__)

FINETUNE_MOUNT = "/finetune"
FETCH_EPOCH = Epoch(0)  # the weights status names a fetch by epoch; a job's fetch is no epoch's


class FinetuneRanks:
    def __init__(
        self,
        node_id: NodeId,
        worker: NodeWorker,
        weights: NodeWeights,
        state: FineTuneState,
        leader_id: Callable[[], str | None],
        weight_urls: Callable[[], dict[str, str]],
    ):
        self.node_id, self.worker, self.weights, self.state = node_id, worker, weights, state
        self._leader_id, self._weight_urls = leader_id, weight_urls
        self.assigned: FinetuneAssign | None = None
        self.child: Child | None = None
        self.rank_state: RankState | None = None
        self.error: str | None = None
        self.fetched = self.retained = 0
        self.reports: list[StepReport | ValReport] = []
        self.done: RankDone | None = None
        self.changed = asyncio.Event()  # set on every report and state change
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def busy(self) -> bool:
        return self.rank_state in ("fetching", "starting", "training")

    def status(self) -> FinetuneRankStatus | None:
        a = self.assigned
        if a is None or self.rank_state is None:
            return None
        peak = self.done.report.train_peak if self.done else 0
        return FinetuneRankStatus(
            job_id=a.job_id,
            rank=a.rank,
            state=self.rank_state,
            error=self.error,
            fetched_bytes=self.fetched,
            retained_bytes=self.retained,
            peak_memory=peak,
        )

    async def assign(self, body: FinetuneAssign) -> FinetuneAccepted:
        if body.leader != self._leader_id():
            raise ControlRefused(f"{body.leader} is not my leader")
        await self._stop()
        await self.worker.replace(None)  # the serving rank lets the memory go first
        self._loop = asyncio.get_running_loop()
        self.assigned, self.error, self.done, self.reports = body, None, None, []
        self.fetched = self.retained = 0
        self._set("fetching")
        self._task = asyncio.create_task(self._prepare(body), name=f"finetune-{body.job_id}")
        return FinetuneAccepted(job_id=body.job_id)

    async def stop(self, body: FinetuneStop) -> FinetuneStopped:
        if self.assigned is not None and self.assigned.job_id == body.job_id:
            await self._stop()
            if self.busy:
                self._set("stopped")
        return FinetuneStopped(job_id=body.job_id)

    async def _stop(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        child, self.child = self.child, None
        if child is not None:
            await self.worker.stop_finetune(child)

    def _set(self, state: RankState, error: str | None = None) -> None:
        self.rank_state = state
        if error is not None:
            self.error = error
        self.changed.set()

    async def _prepare(self, body: FinetuneAssign) -> None:
        try:
            job_dir = self.state.job_dir(body.job_id)
            data = self.state.data_dir(body.job_id)
            data.mkdir(parents=True, exist_ok=True)
            (data / "train.jsonl").write_text(body.train)
            valid = data / "valid.jsonl"
            valid.unlink(missing_ok=True)
            if body.valid:
                valid.write_text(body.valid)
            folder = await self.weights.receive(body.weights, FETCH_EPOCH, self._weight_urls())
            fetch = self.weights.fetch
            if fetch is not None and body.weights.needs_fetch and fetch.state == "done":
                self.fetched = fetch.progress.bytes_done if fetch.progress else fetch.planned_bytes
                self.retained = fetch.retained_bytes
            job = replace(
                body.job,
                model_dir=str(folder),
                data_dir=str(data),
                adapter_path=str(self.state.adapter_dir(body.job_id)),
            )
            jobfile = job_dir / f"rank-{body.rank}.json"
            jobfile.write_text(job.model_dump_json())
            self.child = self._start(body, jobfile, job_dir)
            self._set("starting")
        except asyncio.CancelledError:
            raise
        except Exception as error:  # in the status: the leader fails the job
            message = str(error) if isinstance(error, ExoTpError) else repr(error)
            if isinstance(error, EXPECTED_FETCH_ERRORS):
                log.warning("fine-tuning %s: %s", body.job_id, message)
            else:  # a bug: the job still fails over it, and its traceback is in the log
                log.exception("fine-tuning %s: starting the rank failed", body.job_id)
            self._set("failed", f"node {self.node_id}: {message}")

    def _start(self, body: FinetuneAssign, jobfile: Path, job_dir: Path) -> Child:
        env = clean_environment()
        env[RANK_ENV] = str(body.rank)
        env.update(group_threads(body.hostfile, body.rank, env))
        if len(body.hostfile) > 1:
            hostfile = job_dir / f"hostfile-{body.rank}.json"
            write_hostfile(hostfile, body.hostfile)
            env.update(ring_env(body.rank, hostfile, env))
        job = Job(
            name=f"fine-tuning rank {body.rank}",
            module="exo_tp.finetune.worker",
            argv=(str(jobfile),),
            env=env,
            stdout="null",  # mlx-lm's progress lines; the reports come over the link
        )
        log.info("fine-tuning %s: rank %d starts", body.job_id, body.rank)
        return self.worker.start_finetune(job, self._from_thread)

    def _from_thread(self, child: Child, event: ProcessEvent) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._event, child, event)

    def _event(self, child: Child, event: ProcessEvent) -> None:
        if child is not self.child:
            return
        if isinstance(event, Heartbeat) and isinstance(event.message, RankProgress):
            report = event.message.train or event.message.val
            if report is not None:
                self.reports.append(report)
            self._set("training")
        elif isinstance(child.result, RankDone) and self.done is None:
            self.done = child.result
            self.changed.set()
        if isinstance(event, Failed):
            self._set("failed", f"rank {self.assigned.rank if self.assigned else '?'} on node "
                      f"{self.node_id}: {child.reported or child.error or 'failed'}")  # fmt: skip
        elif isinstance(event, Exited):
            if isinstance(child.result, RankDone):
                self.done = child.result
                self._set("done")
            elif self.rank_state != "stopped":
                self._set("failed", f"node {self.node_id}: its rank exited without a report")

    async def drop_orphan(self, alive: tuple[str, ...]) -> None:
        """Stop this node's rank when the leader that assigned it is gone (its job is)."""
        a = self.assigned
        if a is not None and self.busy and a.leader != self.node_id and a.leader not in alive:
            log.warning("fine-tuning %s: leader %s is gone; stopping my rank", a.job_id, a.leader)
            await self._stop()
            self._set("stopped")

    def fine_tuned(self) -> tuple[FineTunedModel, ...]:
        return tuple(
            FineTunedModel(
                name=job.fine_tuned_model, base=job.model, created=job.finished_at or job.created_at
            )
            for job in self.state.jobs.values()
            if job.fine_tuned_model
        )

    async def close(self) -> None:
        await self._stop()


def finetune_app(secret: str, ranks: FinetuneRanks) -> web.Application:
    """The signed routes the leader calls (mounted on the control server)."""
    return signed_app(
        secret,
        [
            post("/assign", FinetuneAssign, ranks.assign),
            post("/stop", FinetuneStop, ranks.stop),
        ],
        # the training data travels in the assignment (up to the API's file limit, twice:
        # training and validation, JSON-escaped)
        client_max_size=4 * MAX_BODY + (1 << 20),
    )
