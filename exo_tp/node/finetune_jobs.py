"""Fine-tuning behind OpenAI's API, on the cluster's own nodes (the leader runs the jobs).

The API's files and jobs live on disk (`exo_tp.finetune.state`). Every input is checked before
a job starts: each JSONL line, the number of examples against the batch, the base model (known
to the cluster, dense). A job then runs on the leader's cluster, one job at a time:

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

from exo_tp.api.errors import ApiError
from exo_tp.errors import ExoTpError
from exo_tp.finetune.boxes import finetune_boxes
from exo_tp.finetune.data import DataError, check_jsonl, epoch_steps
from exo_tp.finetune.job import FinetuneJob, LoraSettings, StepReport, ValReport
from exo_tp.finetune.openai_schema import (
    FINISHED,
    Checkpoint,
    CheckpointMetrics,
    CreateJob,
    EventData,
    FileObject,
    Hyperparameters,
    Job,
    JobError,
    JobEvent,
    JobHyperparameters,
    JobMethod,
    JobSupervised,
    LoraOptions,
    Progress,
)
from exo_tp.finetune.plan import FinetunePlan, plan_finetune
from exo_tp.finetune.state import ADAPTER_FILES, FineTuneState, new_id
from exo_tp.frozen import replace
from exo_tp.node.announcement import Announcement
from exo_tp.node.cluster_model import Prepared
from exo_tp.node.control import ControlClient
from exo_tp.node.finetune_messages import (
    FinetuneAccepted,
    FinetuneAssign,
    FinetuneStop,
    FinetuneStopped,
)
from exo_tp.node.finetune_ranks import FinetuneRanks
from exo_tp.node.formation import node_weights
from exo_tp.node.weight_messages import WeightOrder
from exo_tp.node.weights import ManifestPending
from exo_tp.plan.cost import weight_format
from exo_tp.plan.devices import ProfileSummary
from exo_tp.weights.transfer import plan_shares
from exo_tp.wire.errors import PeerRefused
from exo_tp.wire.http import SignedClient

if TYPE_CHECKING:
    from exo_tp.node.status_views import StatusViews

log = logging.getLogger(__name__)

BASE_LEARNING_RATE = 1e-5  # mlx_lm.lora's default; OpenAI's multiplier scales it
DEFAULT_EPOCHS = 3
DEFAULT_BATCH = 4
DEAD_AFTER = 4.0  # seconds without a status: the node is gone (the job fails)
WATCH_SECONDS = 0.5
MANIFEST_WAIT = 120.0  # seconds to wait for a holder's first manifest of the model
FT_PREFIX = "ft:"


def not_found(what: str, ident: str, param: str | None = None) -> ApiError:
    return ApiError(
        404, f"No such {what}: '{ident[:200]}'", param=param, code=f"{what.replace(' ', '_')}"
        "_not_found"
    )  # fmt: skip


@dataclass
class Running:
    job_id: str
    nodes: tuple[str, ...]
    task: asyncio.Task[None] | None = None
    cancelled: bool = False


class FineTuning:
    def __init__(
        self,
        node_id: str,
        secret: str,
        state: FineTuneState,
        ranks: FinetuneRanks,
        views: StatusViews,
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

    def _training_file(self, file_id: str, param: str) -> FileObject:
        file = self.state.files.get(file_id)
        if file is None:
            raise ApiError(
                400, f"Invalid file: '{file_id[:100]}' does not exist", param=param,
                code="invalid_file",
            )  # fmt: skip
        if file.purpose != "fine-tune":
            raise ApiError(400, f"{file_id} is not a fine-tune file", param=param)
        return file

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
        train = self._training_file(body.training_file, "training_file")
        valid = (
            self._training_file(body.validation_file, "validation_file")
            if body.validation_file
            else None
        )
        hyper = body.hyperparameters or Hyperparameters()
        if body.method is not None and body.method.supervised is not None:
            hyper = body.method.supervised.hyperparameters or hyper
        joined = self._views.joined
        if joined is None:
            raise ApiError(503, "the node has not joined a cluster yet", kind="server_error",
                           code="cluster_not_ready", retry_after=5)  # fmt: skip
        members = joined.peers.alive_ids()
        batch = DEFAULT_BATCH if hyper.batch_size == "auto" else hyper.batch_size
        if hyper.batch_size == "auto":
            batch = max(min(DEFAULT_BATCH, train.examples), len(members))
        if batch < 1:
            raise ApiError(400, "Invalid value for 'hyperparameters.batch_size': must be >= 1",
                           param="hyperparameters.batch_size")  # fmt: skip
        if batch < len(members):
            raise ApiError(
                400,
                f"batch_size {batch} is smaller than the cluster's {len(members)} nodes: every "
                "node trains on at least one example per step",
                param="hyperparameters.batch_size",
            )
        for file, param in ((train, "training_file"), (valid, "validation_file")):
            if file is not None and file.examples < batch:
                raise ApiError(
                    400,
                    f"{file.id} has {file.examples} examples, fewer than the batch size {batch}",
                    param=param,
                    code="invalid_file",
                )
        epochs = DEFAULT_EPOCHS if hyper.n_epochs == "auto" else hyper.n_epochs
        if epochs < 1:
            raise ApiError(400, "Invalid value for 'hyperparameters.n_epochs': must be >= 1",
                           param="hyperparameters.n_epochs")  # fmt: skip
        iters = hyper.n_iters or epochs * epoch_steps(train.examples, batch)
        multiplier = (
            1.0 if hyper.learning_rate_multiplier == "auto" else hyper.learning_rate_multiplier
        )
        if multiplier <= 0:
            param = "hyperparameters.learning_rate_multiplier"
            raise ApiError(400, f"Invalid value for '{param}': must be > 0", param=param)
        base, layers = await self._check_model(body.model)
        lora = body.lora or LoraOptions()
        if lora.layers is None:
            lora = replace(lora, layers=min(16, layers))
        elif lora.layers > layers:
            raise ApiError(
                400,
                f"lora.layers {lora.layers} is more than the model's {layers} layers",
                param="lora.layers",
            )
        hp = JobHyperparameters(
            n_epochs=epochs,
            batch_size=batch,
            learning_rate_multiplier=multiplier,
            optimizer=hyper.optimizer or "adam",
        )
        job = Job(
            id=new_id("ftjob"),
            created_at=int(time.time()),
            hyperparameters=hp,
            method=JobMethod(supervised=JobSupervised(hyperparameters=hp)),
            model=base,
            seed=body.seed if body.seed is not None else 0,
            status="queued",
            training_file=train.id,
            validation_file=valid.id if valid else None,
            suffix=body.suffix or None,
            user_provided_suffix=body.suffix or None,
            metadata=body.metadata,
            iterations=iters,
            lora=lora,
            progress=Progress(total_steps=iters),
        )
        self.state.save_job(job)
        self._event(job.id, f"Created fine-tuning job: {job.id}")
        self.running = Running(job_id=job.id, nodes=())
        self.running.task = asyncio.create_task(self._run(job.id), name=f"finetune-{job.id}")
        return job

    async def _check_model(self, name: str) -> tuple[str, int]:
        """The base model's name and its number of layers; 4xx for one that cannot be
        fine-tuned here."""
        joined = self._views.joined
        assert joined is not None
        key = joined.models.key_of(name)
        if key is None:
            listed = ", ".join(f"'{n}'" for n, _ in joined.models.listing()) or "none"
            raise ApiError(
                404, f"The model '{name[:200]}' does not exist; this cluster has: {listed}.",
                param="model", code="model_not_found",
            )  # fmt: skip
        try:
            prepared = await joined.models.prepare(key, joined.peers.alive_ids())
        except (ExoTpError, aiohttp.ClientError, TimeoutError) as error:
            raise ApiError(503, f"cannot read the model '{name}': {error}",
                           kind="server_error", code="model_unavailable",
                           retry_after=10) from None  # fmt: skip
        spec = prepared.spec
        if spec.num_experts:
            raise ApiError(
                400,
                f"The model '{name}' ({spec.model_type}) is a mixture of experts: exo-tp "
                "fine-tunes dense models only",
                param="model",
                code="model_not_supported",
            )
        return prepared.name, spec.num_layers

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

    def _event(
        self, job_id: str, message: str, level: str = "info", data: EventData | None = None
    ) -> None:
        self.state.add_event(
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
                self._results(job_id)
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
        profiles: dict[str, ProfileSummary | None] = {}
        memory: list[float] = []
        for member in members:
            status = joined.peers.status(member.node_id)
            profiles[member.node_id] = status.profile if status else None
            available = status.memory.available if status else None
            memory.append(float(available or member.memory_available or 1))
        speeds = node_weights(members, profiles, weight_format(model.spec))
        plan = plan_finetune(memory, speeds, job.hyperparameters.batch_size)
        orders = await self._orders(model, members, plan)
        ports = await asyncio.gather(*(self._control.ports(m, 0) for m in members))
        hostfile = tuple(f"{m.host}:{p.ring}" for m, p in zip(members, ports, strict=True))
        iters = job.iterations
        settings = FinetuneJob(
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
        train = self.state.data_path(job.training_file).read_text()
        valid = self.state.data_path(job.validation_file).read_text() if job.validation_file else ""
        self.state.update(job_id, status="running", nodes=ids)
        self._event(
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

    async def _orders(
        self, model: Prepared, members: list[Announcement], plan: FinetunePlan
    ) -> dict[str, WeightOrder]:
        joined = self._views.joined
        assert joined is not None
        deadline = time.monotonic() + MANIFEST_WAIT
        while True:  # a holder computes a folder's manifest once, the first time it is asked
            try:
                holdings = await joined.models.holdings(model, members)
                break
            except ManifestPending:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(1.0)
        if holdings.manifest is None:  # every node has the files: each reads its rows there
            return {m.node_id: WeightOrder(key=model.key, name=model.name) for m in members}
        manifest = holdings.manifest
        shares = [finetune_boxes(manifest, plan, r) for r in range(len(members))]
        order = [m.node_id for m in members]
        transfer = plan_shares(manifest, shares, order, holdings.held)
        log.info(
            "fine-tuning: %.1f MB of base rows move, %.1f MB stay where they are",
            transfer.moved_bytes / 1e6,
            transfer.retained_bytes / 1e6,
        )
        return {
            n: WeightOrder(
                key=model.key,
                name=model.name,
                identity=manifest.identity,
                transfer=transfer.node(n),
            )
            for n in order
        }

    async def _watch(self, job_id: str, nodes: tuple[str, ...]) -> None:
        """Until every rank is done; raises on the first failure (naming a node that stopped
        answering before a rank that lost its ring)."""
        joined = self._views.joined
        assert joined is not None
        seen = 0
        while True:
            self.ranks.changed.clear()
            reports = self.ranks.reports
            for report in reports[seen:]:
                self._report(job_id, report)
            seen = len(reports)
            gone = [
                n
                for n in nodes
                if n != self.node_id and joined.peers.status(n, max_age=DEAD_AFTER) is None
            ]
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
                self._event(
                    job_id,
                    "Bytes of base rows each node fetched: "
                    + ", ".join(f"{n} {b}" for n, b in fetched.items()),
                )
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.ranks.changed.wait(), WATCH_SECONDS)

    async def _name_the_dead(self, nodes: tuple[str, ...]) -> None:
        """Raise naming a node that stopped answering, if one did (a rank whose ring broke
        fails at once; its peer's status goes stale within DEAD_AFTER)."""
        joined = self._views.joined
        assert joined is not None
        deadline = time.monotonic() + DEAD_AFTER + 1.0
        while time.monotonic() < deadline:
            gone = [
                n
                for n in nodes
                if n != self.node_id and joined.peers.status(n, max_age=DEAD_AFTER) is None
            ]
            if gone:
                raise ExoTpError(
                    f"node {', '.join(gone)} stopped answering during training; the job's "
                    "other ranks were stopped"
                )
            await asyncio.sleep(0.25)

    def _report(self, job_id: str, report: StepReport | ValReport) -> None:
        job = self.job(job_id)
        if isinstance(report, StepReport):
            data = EventData(
                step=report.iteration,
                train_loss=report.train_loss,
                learning_rate=report.learning_rate,
                tokens_per_second=report.tokens_per_second,
            )
            message = (
                f"Step {report.iteration}/{job.iterations}: training loss={report.train_loss:.4f}"
            )
            progress = replace(job.progress, step=report.iteration, train_loss=report.train_loss)
        else:
            data = EventData(step=report.iteration, valid_loss=report.val_loss)
            message = (
                f"Step {report.iteration}/{job.iterations}: validation loss={report.val_loss:.4f}"
            )
            progress = replace(job.progress, val_loss=report.val_loss)
        self.state.update(job_id, progress=progress)
        self._event(job_id, message, data=data)

    async def _stop_all(self, job_id: str, nodes: tuple[str, ...]) -> None:
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

    def _results(self, job_id: str) -> None:
        job = self.job(job_id)
        adapter = self.state.adapter_dir(job_id)
        results = []
        for name in ADAPTER_FILES:
            path = adapter / name
            if path.is_file():
                raw = path.read_bytes()
                file = self.state.add_file(
                    f"{job_id}-{name}", raw, "fine-tune-results", 0, "adapter"
                )
                results.append(file.id)
        suffix = job.suffix or "exo-tp"
        name = f"{FT_PREFIX}{job.model}:{suffix}:{job_id}"
        self.state.update(job_id, fine_tuned_model=name, result_files=tuple(results))
        last = job.progress
        self.state.add_checkpoint(
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

    async def close(self) -> None:
        running = self.running
        if running is not None and running.task is not None:
            running.cancelled = True
            running.task.cancel()
            await asyncio.gather(running.task, return_exceptions=True)
        await self._client.close()
