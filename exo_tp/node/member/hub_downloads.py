"""Hub models a request or the model picker asked for and no member has: downloaded here (on
the leader, which handles every such request), once, in a thread, with progress for the views.
When one finishes, the model joins this node's offers and is loaded; every other member then
receives only its shard from peers over the weights transfer, never from the hub."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from exo_tp.models.hub import DownloadProgress, HubError, HubRef, download
from exo_tp.node.member.weights import NodeWeights

log = logging.getLogger(__name__)

FAILURE_MEMORY = 60.0  # seconds a failed download's error answers requests before a new try


class HubDownloads:
    def __init__(self, weights: NodeWeights) -> None:
        self.weights = weights
        self.progress: dict[str, DownloadProgress] = {}
        self.errors: dict[str, tuple[HubError, float]] = {}  # model -> (error, when)
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def want(self, ref: HubRef, done: Callable[[str], None]) -> DownloadProgress | None:
        """Start (or keep) downloading ``ref``; ``done(key)`` runs once it is this node's.
        Raises the HubError of a recent failed try; None until the first progress report."""
        name = str(ref)
        failed = self.errors.get(name)
        if failed is not None:
            if time.monotonic() - failed[1] < FAILURE_MEMORY:
                raise failed[0]
            del self.errors[name]
        if name not in self._tasks or self._tasks[name].done():
            self._tasks[name] = asyncio.create_task(self._run(ref, done), name=f"hub {name}")
        return self.progress.get(name)

    async def _run(self, ref: HubRef, done: Callable[[str], None]) -> None:
        name = str(ref)
        loop = asyncio.get_running_loop()

        def report(update: DownloadProgress) -> None:
            loop.call_soon_threadsafe(self.progress.__setitem__, name, update)

        try:
            folder = await asyncio.to_thread(download, ref, report)
            key = await asyncio.to_thread(self.weights.add_folder, name, folder)
        except HubError as error:
            log.warning("%s", error)
            self.errors[name] = (error, time.monotonic())
            self.progress[name] = DownloadProgress(
                model=name, done=0, total=0, state="failed", error=str(error)
            )
            return
        total = self.progress.get(name, _zero(name)).total
        self.progress[name] = DownloadProgress(model=name, done=total, total=total, state="done")
        done(key)

    def views(self) -> tuple[DownloadProgress, ...]:
        return tuple(self.progress[name] for name in sorted(self.progress))

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()


def _zero(name: str) -> DownloadProgress:
    return DownloadProgress(model=name, done=0, total=0, state="downloading")
