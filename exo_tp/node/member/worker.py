"""This node's worker: the rank process of its current epoch, started and watched by the one
supervisor (`exo_tp.process.supervisor`, the same one `exo-tp launch` uses)."""

from __future__ import annotations

import asyncio
import logging

from exo_tp.node.cluster.control_messages import MachineMemory, Stall, WorkerState
from exo_tp.node.cluster.memory import memory_now
from exo_tp.plan.rebalance import RankSpeed
from exo_tp.process.events import Exited, Failed, ProcessEvent
from exo_tp.process.supervisor import Child, Job, OnEvent, Supervisor
from exo_tp.runtime.rank_process import rank_job, rank_memory, rank_ready, rank_speed
from exo_tp.wire.assignment import Assignment
from exo_tp.wire.ids import Epoch, NodeId
from exo_tp.wire.profiles import LinkProfile
from exo_tp.wire.runtime import RANK_EVENTS, RankMemory

log = logging.getLogger(__name__)


class NodeWorker:
    def __init__(self, secret: str, stall_timeout: float):
        self._loop: asyncio.AbstractEventLoop | None = None
        self._key, self._stall_timeout = secret.encode(), stall_timeout
        self._supervisor = Supervisor(self._from_thread, RANK_EVENTS, self._key, "node supervisor")
        self.rank: Child | None = None
        # A fine-tuning job's rank (exo_tp.node.finetune.ranks): a supervisor of its own, as its
        # messages are a fine-tuning rank's, not a serving rank's; same key, same watchdog.
        self._finetune: Supervisor | None = None
        self._finetune_handler: OnEvent | None = None
        self._assignment: Assignment | None = None
        self.assigned_by: str | None = None
        # the last worker's stall, reported until a new worker starts (the leader stops a
        # frozen worker soon after it is found)
        self.last_stall: tuple[Stall, str] | None = None

    def _from_thread(self, child: Child, event: ProcessEvent) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._changed, child, event)

    def _changed(self, child: Child, event: ProcessEvent) -> None:
        if child is self.rank and isinstance(event, Failed | Exited) and self.epoch is not None:
            log.warning("epoch %d worker: %s", self.epoch, child.error or "exited")

    async def replace(self, assignment: Assignment | None, leader: NodeId | None = None) -> None:
        """Stop the current worker (if any) and start one for ``assignment`` (if any)."""
        self._loop = asyncio.get_running_loop()
        old, self.rank, self._assignment = self.rank, None, None
        if old is not None:
            if old.stalled is not None:
                self.last_stall = (old.stalled, old.error or "stalled")
            await asyncio.to_thread(self._supervisor.stop, old)
        self.assigned_by = leader
        if assignment is not None:
            self.last_stall = None
            job = rank_job(assignment, self._key, self._stall_timeout)
            self.rank, self._assignment = self._supervisor.start(job), assignment
            log.info(
                "epoch %d: worker started as rank %d of %d",
                assignment.epoch,
                assignment.rank,
                assignment.plan.size,
            )

    def start_finetune(self, job: Job, on_event: OnEvent) -> Child:
        """Start a fine-tuning rank (the serving worker was stopped before)."""
        from exo_tp.wire.finetune_job import RANK_EVENTS as FINETUNE_EVENTS

        if self._finetune is None:
            self._finetune = Supervisor(
                self._finetune_event, FINETUNE_EVENTS, self._key, "finetune supervisor"
            )
        self._finetune_handler = on_event  # the job's own (called on the supervisor's threads)
        return self._finetune.start(job)

    def _finetune_event(self, child: Child, event: ProcessEvent) -> None:
        if self._finetune_handler is not None:
            self._finetune_handler(child, event)

    async def stop_finetune(self, child: Child) -> None:
        if self._finetune is not None:
            await asyncio.to_thread(self._finetune.stop, child)

    async def close(self) -> None:
        await self.replace(None)
        await asyncio.to_thread(self._supervisor.close)
        if self._finetune is not None:
            await asyncio.to_thread(self._finetune.close)

    # ---- what the node reports -------------------------------------------------------------

    @property
    def assignment(self) -> Assignment | None:
        return self._assignment

    @property
    def epoch(self) -> Epoch | None:
        return self._assignment.epoch if self._assignment else None

    @property
    def state(self) -> WorkerState:
        rank = self.rank
        if rank is None:
            return "none"
        if rank.state in ("ready", "exited"):
            return rank.state
        if rank.state == "connected":  # joining its group, then loading its shard
            return "loading" if rank.phase == "loading" else "joining"
        return "starting"

    @property
    def error(self) -> str | None:
        if self.rank is not None:
            return self.rank.error
        return self.last_stall[1] if self.last_stall else None

    @property
    def stalled(self) -> Stall | None:
        if self.rank is not None:
            return self.rank.stalled
        return self.last_stall[0] if self.last_stall else None

    @property
    def links(self) -> tuple[LinkProfile, ...]:
        ready = rank_ready(self.rank) if self.rank and self.rank.state == "ready" else None
        return ready.links if ready else ()

    @property
    def speed(self) -> RankSpeed | None:
        """The rank's latest live speed sample (rebalancing)."""
        return rank_speed(self.rank) if self.rank and self.rank.state == "ready" else None

    @property
    def rank_memory(self) -> RankMemory | None:
        return rank_memory(self.rank) if self.rank else None

    def machine_memory(self) -> MachineMemory:
        pid = self.rank.process.pid if self.rank and self.rank.state != "exited" else None
        return MachineMemory(**memory_now(pid))
