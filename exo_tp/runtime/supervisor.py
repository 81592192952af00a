"""Starting rank processes and hearing from them: one piece for `exo-tp launch` (every rank of
a job on this machine) and the node daemon (its one rank per epoch).

Each rank gets a private folder (its job, its stage's hostfile) named after this process, so a
later start on the machine removes the folders of supervisors that died (kill -9) without
cleaning up. A watchdog turns silence into a verdict: a rank whose heartbeats stop is frozen; a
rank that is busy but completes no batch step for ``stall_timeout`` seconds is stuck (usually
waiting in a collective for a frozen peer).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import psutil

from exo_tp.plan.rebalance import RankSpeed
from exo_tp.runtime.job import LINK_KEY_ENV, Assignment
from exo_tp.transport.channel import Channel, Listener
from exo_tp.transport.ring import jaccl_env, ring_env, write_hostfile
from exo_tp.wire.runtime import (
    RANK_EVENTS,
    Heartbeat,
    Joining,
    Loading,
    RankFailed,
    RankMemory,
    Ready,
)

log = logging.getLogger(__name__)

FOLDER_PREFIX = "exo-tp-rank-"
GROUP_ENV_PREFIXES = ("MLX_RANK", "MLX_HOSTFILE", "MLX_JACCL_COORDINATOR", "MLX_IBV_DEVICES")
SECRET_ENV_NAMES = ("EXO_TP_SECRET", LINK_KEY_ENV)

RankState = Literal["starting", "joining", "loading", "ready", "exited"]
Stall = Literal["frozen", "stuck"]


def remove_orphaned_folders() -> None:
    """Rank folders of supervisors that are no longer running (killed before cleaning up)."""
    for folder in Path(tempfile.gettempdir()).glob(f"{FOLDER_PREFIX}*"):
        try:
            owner = int(folder.name.removeprefix(FOLDER_PREFIX).split("-")[0])
        except ValueError:
            continue
        if not psutil.pid_exists(owner):
            shutil.rmtree(folder, ignore_errors=True)


def clean_environment() -> dict[str, str]:
    """This process's environment without any MLX group or secret of ours: what a child rank
    (served or fine-tuning) starts from."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(GROUP_ENV_PREFIXES) and k not in SECRET_ENV_NAMES
    }


def rank_environment(job: Assignment, folder: Path, key: bytes) -> dict[str, str]:
    """The rank's environment: `clean_environment` plus its link key and its stage's group
    (none for a stage of one rank)."""
    env = clean_environment()
    env[LINK_KEY_ENV] = key.hex()
    stage = job.plan.stages[job.stage_index]
    if stage.size > 1 and job.backend == "jaccl":
        devices = folder / "ibv_devices.json"
        matrix = job.ibv_devices or ()
        devices.write_text(json.dumps([[matrix[i][j] for j in stage.ranks] for i in stage.ranks]))
        # the stage's first ring address is free under jaccl: its coordinator listens there
        env.update(jaccl_env(job.local_rank, job.hostfile[stage.ranks[0]], devices))
    elif stage.size > 1:
        hostfile = folder / "hostfile.json"
        write_hostfile(hostfile, [job.hostfile[r] for r in stage.ranks])
        env.update(ring_env(job.local_rank, hostfile))
    return env


@dataclass
class RankStatus:
    """What the supervisor knows of one rank it started."""

    job: Assignment
    process: subprocess.Popen[bytes]
    folder: Path
    state: RankState = "starting"
    error: str | None = None
    ready: Ready | None = None
    memory: RankMemory = field(default_factory=RankMemory)
    last_heard: float = field(default_factory=time.monotonic)
    steps: int = 0
    busy: bool = False
    progressed: float = field(default_factory=time.monotonic)  # when ``steps`` last grew
    stalled: Stall | None = None
    speed: RankSpeed | None = None  # its latest live speed sample, if it probes
    stopping: bool = False  # stopped on purpose: its exit is no news
    channel: Channel[Joining | Loading | Ready | Heartbeat | RankFailed] | None = None


# Called on the supervisor's threads: (rank status) after each change of state or stall.
OnChange = Callable[[RankStatus], None]


class Supervisor:
    def __init__(self, key: bytes, on_change: OnChange, stall_timeout: float = 30.0):
        remove_orphaned_folders()
        self._key, self._on_change, self.stall_timeout = key, on_change, stall_timeout
        self._ranks: dict[tuple[int, int], RankStatus] = {}  # (epoch, rank)
        self._lock = threading.Lock()
        self._listener = Listener("127.0.0.1:0", key, RANK_EVENTS, self._on_channel, "supervisor")
        self._closed = threading.Event()
        threading.Thread(target=self._watch, name="watchdog", daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self._listener.port}"

    def start(self, job: Assignment, extra_env: Mapping[str, str] | None = None) -> RankStatus:
        folder = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-"))
        jobfile = folder / "job.json"
        jobfile.write_text(job.model_dump_json())
        # Ranks never write to stdout (`exo-tp launch` prints only the text there).
        process = subprocess.Popen(
            [sys.executable, "-m", "exo_tp.runtime.rank", str(jobfile), self.address],
            env={**rank_environment(job, folder, self._key), **(extra_env or {})},
            stdout=sys.stderr.fileno(),
        )
        status = RankStatus(job, process, folder)
        with self._lock:
            self._ranks[(job.epoch, job.rank)] = status
        threading.Thread(target=self._wait_exit, args=(status,), daemon=True).start()
        return status

    def _on_channel(
        self,
        channel: Channel[Joining | Loading | Ready | Heartbeat | RankFailed],
    ) -> None:
        first = channel.recv()
        status = None
        if isinstance(first, Joining):
            with self._lock:
                status = self._ranks.get((first.epoch, first.rank))
        if status is None or status.channel is not None:
            log.warning("supervisor: unexpected rank connection (%s)", first)
            channel.close()
            return
        status.channel = channel
        self._update(status, "joining")
        while (event := channel.recv()) is not None:
            status.last_heard = time.monotonic()
            if isinstance(event, Loading):
                self._update(status, "loading")
            elif isinstance(event, Ready):
                status.ready, status.memory = event, event.memory
                self._update(status, "ready")
            elif isinstance(event, Heartbeat):
                status.memory, status.busy = event.memory, event.busy
                status.speed = event.speed or status.speed
                if event.steps != status.steps or not event.busy:
                    status.steps, status.progressed = event.steps, time.monotonic()
            elif isinstance(event, RankFailed):
                status.error = f"failed: {event.message}"

    def _update(self, status: RankStatus, state: RankState) -> None:
        if status.state != "exited":
            status.state = state
        self._on_change(status)

    def _wait_exit(self, status: RankStatus) -> None:
        code = status.process.wait()
        if status.stopping:
            return
        status.error = status.error or exit_text(code)
        status.state = "exited"
        self._on_change(status)

    def _watch(self) -> None:
        while not self._closed.wait(1.0):
            now = time.monotonic()
            with self._lock:
                ranks = list(self._ranks.values())
            for status in ranks:
                if status.state != "ready" or status.stalled is not None:
                    continue
                if now - status.last_heard > self.stall_timeout:
                    status.stalled = "frozen"
                elif status.busy and now - status.progressed > 2 * self.stall_timeout:
                    # later than "frozen": the peers of a frozen rank get stuck waiting on it,
                    # and the frozen one is the culprit to report
                    status.stalled = "stuck"
                else:
                    continue
                status.error = (
                    f"made no progress for {self.stall_timeout:g}s (no heartbeat: frozen?)"
                    if status.stalled == "frozen"
                    else f"made no progress for {2 * self.stall_timeout:g}s (waiting on a peer)"
                )
                self._on_change(status)

    def stop(self, status: RankStatus) -> None:
        """Kill the rank (it may be spinning in a collective of a broken ring) and remove
        its folder."""
        status.stopping, status.state = True, "exited"
        if status.channel is not None:
            status.channel.close()
        if status.process.poll() is None:
            status.process.kill()
        status.process.wait()
        shutil.rmtree(status.folder, ignore_errors=True)
        with self._lock:
            self._ranks.pop((status.job.epoch, status.job.rank), None)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            ranks = list(self._ranks.values())
        for status in ranks:
            self.stop(status)
        self._listener.close()


def exit_text(code: int) -> str:
    """A rank's end, as the leader tells every stream: its signal's name, or its exit code."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return f"was killed by signal {name}"
    return f"exited with code {code}"
