"""Ranks of one plan on this machine, serving requests sent from this process: what `exo-tp
launch` (one request) and the library's `exo_tp.load` (many, concurrently) stand on.

The ranks are the same rank program a node runs (`exo_tp.runtime.rank`), started by the same
supervisor (`exo_tp.process.supervisor`), each stage with its own MLX ring on 127.0.0.1 and
private ports. This process is their supervisor and their request source: the conductor (the
last stage's first rank) connects back to it, and everything the ranks and the conductor say
arrives in one queue (`events`). A rank that dies or stalls, or a ring not joined in time, ends
the whole set with one error naming it.
"""

from __future__ import annotations

import queue
import secrets
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from exo_tp.errors import ExoTpError
from exo_tp.frozen import Frozen
from exo_tp.plan.pipeline import PipelinePlan
from exo_tp.process.events import Exited, Failed, ProcessEvent
from exo_tp.process.supervisor import Child, Supervisor
from exo_tp.runtime.rank_process import rank_job
from exo_tp.transport.channel import Channel, Listener
from exo_tp.transport.ports import free_ports
from exo_tp.wire.assignment import Assignment, DType, ServingOptions
from exo_tp.wire.ids import Epoch, Rank, RequestId
from exo_tp.wire.runtime import (
    CONDUCTOR_EVENTS,
    RANK_EVENTS,
    Cancel,
    Delta,
    Done,
    Generate,
    GenerateRequest,
    Hello,
    RequestFailed,
)

ADDRESS = "127.0.0.1"


@dataclass(frozen=True)
class RankNews:
    """The supervisor's news of one rank."""

    child: Child
    event: ProcessEvent


class JoinDeadline(Frozen):
    """The join timeout passed: every rank should be past joining its ring by now."""

    kind: Literal["join_deadline"] = "join_deadline"


Answer = Delta | Done | RequestFailed  # what the conductor says of a request
LaunchEvent = RankNews | JoinDeadline | Hello | Answer
ConductorLink = Channel[Hello | Delta | Done | RequestFailed]


def _jobs(
    model: str,
    plan: PipelinePlan,
    dtype: DType,
    source_port: int,
    adapter_path: str | None,
    serving: ServingOptions,
) -> list[Assignment]:
    hostfile: list[str] = [""] * plan.size
    for stage in plan.stages:  # one ring (and port range) per stage
        for rank, port in zip(stage.ranks, free_ports(stage.size), strict=True):
            hostfile[rank] = f"{ADDRESS}:{port}"
    conductor, *hops = free_ports(1 + (plan.size if len(plan.stages) > 1 else 0))
    return [
        Assignment(
            epoch=Epoch(0),
            model=model,
            plan=plan,
            rank=Rank(rank),
            hostfile=tuple(hostfile),
            conductor=f"{ADDRESS}:{conductor}",
            requests_at=f"{ADDRESS}:{source_port}",
            hops=tuple(f"{ADDRESS}:{p}" for p in hops),
            dtype=dtype,
            measure_links=False,
            serving=serving,
            adapter_path=adapter_path,
        )
        for rank in range(plan.size)
    ]


def _joined(child: Child) -> bool:
    """Past joining its ring (loading, serving, or gone)."""
    return child.phase is not None or child.state in ("ready", "exited")


def _failure(news: RankNews) -> ExoTpError | None:
    child = news.child
    if isinstance(news.event, Failed | Exited):  # a rank never leaves while the set serves
        error = child.error or "exited with code 0"
        return ExoTpError(f"{child.name} {error}; stopped the other ranks")
    return None


class LocalRanks:
    """A plan's ranks on this machine, started at construction; `wait_ready` until the
    conductor is there, then `send` requests and read `next_answer`; `close` stops them."""

    def __init__(
        self,
        model: str,
        plan: PipelinePlan,
        dtype: DType,
        serving: ServingOptions,
        adapter_path: str | None = None,
        rank_env: Sequence[Mapping[str, str]] | None = None,
        join_timeout: float = 120.0,
        stall_timeout: float = 60.0,
    ):
        """``rank_env``: variables added to each rank's environment (the lab's work factors,
        the library's BLAS preload)."""
        self.join_timeout = join_timeout
        key = secrets.token_bytes(32)
        self.events: queue.Queue[LaunchEvent] = queue.Queue()
        self.conductor: ConductorLink | None = None
        self._source = Listener(f"{ADDRESS}:0", key, CONDUCTOR_EVENTS, self._on_conductor, "launch")
        self._supervisor = Supervisor(self._on_rank, RANK_EVENTS, key, "launch supervisor")
        jobs = _jobs(model, plan, dtype, self._source.port, adapter_path, serving)
        self.ranks = [
            self._supervisor.start(
                rank_job(job, key, stall_timeout, rank_env[job.rank] if rank_env else None)
            )
            for job in jobs
        ]
        self._joined = threading.Event()
        self._timer = threading.Timer(join_timeout, self._join_deadline)
        self._timer.daemon = True
        self._timer.start()

    def _join_deadline(self) -> None:
        if not self._joined.is_set():
            self.events.put(JoinDeadline())

    def _on_rank(self, child: Child, event: ProcessEvent) -> None:
        self.events.put(RankNews(child, event))

    def _on_conductor(self, channel: ConductorLink) -> None:
        hello = channel.recv()
        if not isinstance(hello, Hello) or self.conductor is not None:
            channel.close()
            return
        self.conductor = channel
        self.events.put(hello)
        while (event := channel.recv()) is not None:
            self.events.put(event)

    def _check(self, event: LaunchEvent) -> None:
        """Raise for a rank that failed or a ring not joined in time."""
        if isinstance(event, JoinDeadline):
            late = [r for r, child in enumerate(self.ranks) if not _joined(child)]
            if late:
                raise ExoTpError(
                    f"ranks {late} did not join the ring within {self.join_timeout:.0f}s"
                )
        elif isinstance(event, RankNews):
            if (error := _failure(event)) is not None:
                raise error
            if all(_joined(child) for child in self.ranks):
                self._joined.set()

    def wait_ready(self) -> None:
        """Until the conductor said hello (every rank loaded its shard); raises ExoTpError."""
        while not isinstance(event := self.events.get(), Hello):
            self._check(event)

    def next_answer(self) -> Answer:
        """The conductor's next word on any request; raises ExoTpError if a rank failed."""
        while True:
            event = self.events.get()
            if isinstance(event, Delta | Done | RequestFailed):
                return event
            self._check(event)

    def send(self, request: GenerateRequest) -> None:
        assert self.conductor is not None, "wait_ready first"
        self.conductor.send(Generate(request=request))

    def cancel(self, request_id: str) -> None:
        if self.conductor is not None:
            self.conductor.send(Cancel(id=RequestId(request_id)))

    def close(self, graceful: bool = True) -> None:
        """Stop the ranks: gracefully, they see the conductor's link close and leave together;
        else (after a failure) the supervisor ends them."""
        if graceful and self.conductor is not None:
            self.conductor.close()
            for child in self.ranks:
                try:
                    child.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    break
        self._joined.set()
        self._timer.cancel()
        self._source.close()
        self._supervisor.close()
