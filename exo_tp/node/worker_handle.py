"""The daemon's side of its worker process: spawn it for an assignment, read its events."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from exo_tp.runtime.job import RANK_ENV, SECRET_ENV, Assignment
from exo_tp.runtime.ring import jaccl_env, ring_env, write_hostfile

log = logging.getLogger(__name__)

_GROUP_ENV = ("MLX_RANK", "MLX_HOSTFILE", "MLX_JACCL_COORDINATOR", "MLX_IBV_DEVICES")
EventHandler = Callable[["WorkerHandle", dict[str, Any]], None]


class WorkerHandle:
    """One worker process for one epoch. ``state``: starting, joining, loading, ready, exited."""

    def __init__(self, assignment: Assignment, on_event: EventHandler, secret: str):
        self.assignment = assignment
        self._secret = secret
        self.state = "starting"
        self.error: str | None = None
        self.links: list[dict[str, Any]] = []  # LinkProfile dicts its stage measured when ready
        self._on_event = on_event
        self._proc: asyncio.subprocess.Process | None = None
        self._server: asyncio.base_events.Server | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="exo-tp-worker-")
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def epoch(self) -> int:
        return self.assignment.epoch

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._on_connect, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        tmp = Path(self._tmp.name)
        job = tmp / "assignment.json"
        job.write_text(self.assignment.model_dump_json())
        env = {k: v for k, v in os.environ.items() if not k.startswith(_GROUP_ENV)}
        env.update({RANK_ENV: str(self.assignment.rank), SECRET_ENV: self._secret})
        plan = self.assignment.plan
        stage = plan.stages[plan.locate(self.assignment.rank)[0]]
        local = stage.ranks.index(self.assignment.rank)
        if stage.size > 1 and self.assignment.backend == "jaccl":
            devices = tmp / "ibv_devices.json"
            matrix = self.assignment.ibv_devices or ()
            devices.write_text(json.dumps([[matrix[i][j] for j in stage.ranks]
                                           for i in stage.ranks]))
            # the stage's first ring address is free under jaccl: its coordinator listens there
            coordinator = self.assignment.hostfile[stage.ranks[0]]
            env.update(jaccl_env(local, coordinator, devices))
        elif stage.size > 1:  # this stage's ranks form their own ring
            hostfile = tmp / "hostfile.json"
            write_hostfile(hostfile, [self.assignment.hostfile[r] for r in stage.ranks])
            env.update(ring_env(local, hostfile))
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "exo_tp.runtime.serve_worker", str(job), f"127.0.0.1:{port}",
            env=env,
        )
        self._tasks.append(asyncio.create_task(self._wait_exit()))

    async def _on_connect(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        if self._writer is not None:  # one worker per handle
            writer.close()
            return
        self._writer = writer
        while line := await reader.readline():
            event = json.loads(line)
            if event["type"] in ("joining", "loading", "ready"):
                self.state = event["type"]
                self.links = event.get("links", self.links)
            elif event["type"] == "error":
                self.error = event.get("message", "worker failed")
            self._on_event(self, event)

    async def _wait_exit(self) -> None:
        assert self._proc is not None
        code = await self._proc.wait()
        if self.state != "exited":
            self.state = "exited"
            self.error = self.error or f"worker exited with code {code}"
            self._on_event(self, {"type": "exited", "code": code})

    def send(self, message: dict[str, Any]) -> bool:
        if self._writer is None or self._writer.is_closing():
            return False
        self._writer.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")
        return True

    async def stop(self) -> None:
        """Kill the worker (it may be spinning in a collective of a broken ring)."""
        self.state = "exited"
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()
            await self._proc.wait()
        if self._writer is not None:
            self._writer.close()
        if self._server is not None:
            self._server.close()
        for task in self._tasks:
            task.cancel()
        self._tmp.cleanup()
