"""A rank's news to its supervisor: its memory and steps in a heartbeat every second, and its
exit when the supervisor closes their link."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from exo_tp.transport.channel import Channel
from exo_tp.wire.runtime import Heartbeat, RankMemory

if TYPE_CHECKING:
    from exo_tp.runtime.batching import LockstepBatch
    from exo_tp.runtime.speed_probe import SpeedProbe

HEARTBEAT_SECONDS = 1.0


class Progress:
    """What the heartbeat reports: read by its thread, written by the serving loop."""

    def __init__(self) -> None:
        self.batch: LockstepBatch | None = None
        self.load_peak = 0
        self.probe: SpeedProbe | None = None

    def memory(self) -> RankMemory:
        return RankMemory(
            load_peak=self.load_peak, peak=mx.get_peak_memory(), active=mx.get_active_memory()
        )

    def heartbeat(self) -> Heartbeat:
        batch = self.batch
        return Heartbeat(
            steps=batch.steps if batch else 0,
            busy=bool(batch and not batch.idle),
            memory=self.memory(),
            speed=self.probe.last if self.probe else None,
        )


def beat(supervisor: Channel[Any], progress: Progress) -> None:
    while True:
        time.sleep(HEARTBEAT_SECONDS)
        try:
            supervisor.send(progress.heartbeat())
        except OSError:
            os._exit(0)


def exit_when_closed(supervisor: Channel[Any]) -> None:
    """The supervisor never writes: its link closing means stop (it replaced this rank)."""
    supervisor.recv_raw()
    os._exit(0)
