"""This node's worker: the rank process of its current epoch, started and watched with the
runtime's supervisor (the same one `exo-tp launch` uses)."""

from __future__ import annotations

import asyncio
import logging

from exo_tp.node.control import MachineMemory, Stall, WorkerState
from exo_tp.node.memory import memory_now
from exo_tp.plan.devices import LinkProfile
from exo_tp.plan.rebalance import RankSpeed
from exo_tp.runtime.job import Assignment
from exo_tp.runtime.supervisor import RankStatus, Supervisor
from exo_tp.wire.runtime import RankMemory

log = logging.getLogger(__name__)


class NodeWorker:
    def __init__(self, secret: str, stall_timeout: float):
        self._loop: asyncio.AbstractEventLoop | None = None
        self._supervisor = Supervisor(secret.encode(), self._from_thread, stall_timeout)
        self.rank: RankStatus | None = None
        self.assigned_by: str | None = None
        # the last worker's stall, reported until a new worker starts (the leader stops a
        # frozen worker soon after it is found)
        self.last_stall: tuple[Stall, str] | None = None

    def _from_thread(self, status: RankStatus) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._changed, status)

    def _changed(self, status: RankStatus) -> None:
        if status is self.rank and (status.state == "exited" or status.stalled):
            log.warning("epoch %d worker: %s", status.job.epoch, status.error)

    async def replace(self, assignment: Assignment | None, leader: str | None = None) -> None:
        """Stop the current worker (if any) and start one for ``assignment`` (if any)."""
        self._loop = asyncio.get_running_loop()
        old, self.rank = self.rank, None
        if old is not None:
            if old.stalled is not None:
                self.last_stall = (old.stalled, old.error or "stalled")
            await asyncio.to_thread(self._supervisor.stop, old)
        self.assigned_by = leader
        if assignment is not None:
            self.last_stall = None
            self.rank = self._supervisor.start(assignment)
            log.info(
                "epoch %d: worker started as rank %d of %d",
                assignment.epoch,
                assignment.rank,
                assignment.plan.size,
            )

    async def close(self) -> None:
        await self.replace(None)
        await asyncio.to_thread(self._supervisor.close)

    # ---- what the node reports -------------------------------------------------------------

    @property
    def assignment(self) -> Assignment | None:
        return self.rank.job if self.rank else None

    @property
    def epoch(self) -> int | None:
        return self.rank.job.epoch if self.rank else None

    @property
    def state(self) -> WorkerState:
        return self.rank.state if self.rank else "none"

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
        ready = self.rank.ready if self.rank and self.rank.state == "ready" else None
        return ready.links if ready else ()

    @property
    def speed(self) -> RankSpeed | None:
        """The rank's latest live speed sample (rebalancing)."""
        return self.rank.speed if self.rank and self.rank.state == "ready" else None

    @property
    def rank_memory(self) -> RankMemory | None:
        return self.rank.memory if self.rank else None

    def machine_memory(self) -> MachineMemory:
        pid = self.rank.process.pid if self.rank and self.rank.state != "exited" else None
        return MachineMemory(**memory_now(pid))
