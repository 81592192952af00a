"""The one supervisor of every process exo-tp starts: serving ranks (a node's, or all of `exo-tp
launch`'s), fine-tuning ranks, link probes and the nodes of `exo-tp run --local-nodes`.

It starts a typed `Job` and reports a typed `ProcessEvent` for it: connected, phase, ready,
heartbeat, result, failed (exit code, signal, stall, or the child's own words) and exited.
Children report over an authenticated channel whose address, key and token they find in
their environment (`exo_tp.process.child`), never as lines on stderr. A watchdog turns silence
into a verdict: a ready child with a stall timeout whose heartbeats stop is frozen; one that is
busy but completes no step for twice that long is stuck (usually waiting on a frozen peer).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import psutil
from pydantic import TypeAdapter

from exo_tp.frozen import Frozen
from exo_tp.process.events import (
    Connected,
    Exited,
    Failed,
    Finished,
    Heartbeat,
    PhaseChanged,
    ProcessEvent,
    Ready,
    Stall,
)
from exo_tp.process.messages import (
    CHILD_EVENTS,
    ChildFailed,
    ChildHeartbeat,
    ChildHello,
    ChildPhase,
    ChildReady,
    ChildResult,
)
from exo_tp.transport.channel import Channel, Listener

log = logging.getLogger(__name__)

# How a child finds its supervisor (`exo_tp.process.child`); none of them is inherited further.
SUPERVISOR_ENV = "EXO_TP_SUPERVISOR"
SUPERVISOR_KEY_ENV = "EXO_TP_SUPERVISOR_KEY"
CHILD_ENV = "EXO_TP_CHILD"
# The supervisor's pid: a child whose parent is no longer it exits (`exo_tp.process.child`).
SUPERVISOR_PID_ENV = "EXO_TP_SUPERVISOR_PID"
# What a child never inherits from this process: an MLX group or secret of ours.
GROUP_ENV_PREFIXES = ("MLX_RANK", "MLX_HOSTFILE", "MLX_JACCL_COORDINATOR", "MLX_IBV_DEVICES")
SECRET_ENV_NAMES = ("EXO_TP_SECRET", "EXO_TP_LINK_KEY", SUPERVISOR_KEY_ENV)
OWN_ENV_NAMES = (SUPERVISOR_ENV, CHILD_ENV, SUPERVISOR_PID_ENV)
# Seconds an exited child's last messages may take to arrive (its socket closes with it).
LAST_WORDS_SECONDS = 2.0

ChildState = Literal["starting", "connected", "ready", "exited"]
Output = Literal["stderr", "null", "inherit"]


def clean_environment() -> dict[str, str]:
    """This process's environment without any MLX group, secret or supervisor link of ours:
    what a child starts from."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(GROUP_ENV_PREFIXES) and k not in SECRET_ENV_NAMES + OWN_ENV_NAMES
    }


def private_folder(prefix: str) -> Path:
    """A fresh folder named after this process, so `remove_orphaned_folders` can tell when
    its owner died (kill -9) without cleaning up."""
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-"))


def remove_orphaned_folders(prefix: str) -> None:
    """``prefix`` folders of processes that are no longer running."""
    for folder in Path(tempfile.gettempdir()).glob(f"{prefix}*"):
        try:
            owner = int(folder.name.removeprefix(prefix).split("-")[0])
        except ValueError:
            continue
        if not psutil.pid_exists(owner):
            shutil.rmtree(folder, ignore_errors=True)


class Job(Frozen):
    """One process to start and watch."""

    name: str  # how errors name it: "rank 1", "local node 0 (port 8000)"
    module: str | None = None  # run ``python -m module *argv`` (else ``argv`` is the command)
    argv: tuple[str, ...] = ()
    env: dict[str, str] | None = None  # the child's environment (None: `clean_environment`)
    cores: tuple[int, ...] | None = None  # CPU affinity (None: any core)
    stall_timeout: float | None = None  # seconds without progress once ready (None: never)
    folder: str | None = None  # a private folder of the child's, removed with it
    stdout: Output = "stderr"  # our stdout is often the user's answer: children stay off it
    stderr_file: str | None = None  # its stderr goes there (None: ours)
    new_session: bool = False  # its own session (a test can kill it with all it started)

    def command(self) -> list[str]:
        return [sys.executable, "-m", self.module, *self.argv] if self.module else [*self.argv]


@dataclass
class Child:
    """What the supervisor knows of one process it started."""

    job: Job
    process: subprocess.Popen[bytes]
    token: str
    state: ChildState = "starting"
    phase: str | None = None
    ready: ChildReady | None = None
    heartbeat: ChildHeartbeat | None = None
    result: ChildResult | None = None
    error: str | None = None  # the latest failure, readable
    stalled: Stall | None = None
    started: float = field(default_factory=time.monotonic)
    last_heard: float = field(default_factory=time.monotonic)
    progressed: float = field(default_factory=time.monotonic)  # when its steps last grew
    stopping: bool = False  # stopped on purpose: its exit is no news
    channel: Channel[Any] | None = None
    reported: str | None = None  # its own words on why it fails
    heard_all: threading.Event = field(default_factory=threading.Event)
    gone: threading.Event = field(default_factory=threading.Event)

    @property
    def name(self) -> str:
        return self.job.name

    @property
    def pid(self) -> int:
        return self.process.pid


# Called on the supervisor's threads with the child and what happened to it.
OnEvent = Callable[[Child, ProcessEvent], None]


class Supervisor:
    """Starts jobs and reports their events to ``on_event``; ``incoming`` is the children's
    link (a union of subclasses of `exo_tp.process.messages`' bases); ``key`` authenticates
    it (default: a fresh one)."""

    def __init__(
        self,
        on_event: OnEvent,
        incoming: TypeAdapter[Any] = CHILD_EVENTS,
        key: bytes | None = None,
        name: str = "supervisor",
    ):
        self.key = key or secrets.token_bytes(32)
        self._on_event = on_event
        self._children: dict[str, Child] = {}  # by token
        self._lock = threading.Lock()
        self._listener = Listener("127.0.0.1:0", self.key, incoming, self._on_channel, name)
        self._closed = threading.Event()
        threading.Thread(target=self._watch, name=f"{name} watchdog", daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self._listener.port}"

    def start(self, job: Job) -> Child:
        token = secrets.token_hex(8)
        env = dict(clean_environment() if job.env is None else job.env)
        env.update(
            {
                SUPERVISOR_ENV: self.address,
                SUPERVISOR_KEY_ENV: self.key.hex(),
                CHILD_ENV: token,
                SUPERVISOR_PID_ENV: str(os.getpid()),
            }
        )
        stdout = {"stderr": sys.stderr.fileno(), "null": subprocess.DEVNULL, "inherit": None}
        with contextlib.ExitStack() as files:
            stderr = (
                files.enter_context(open(job.stderr_file, "ab"))  # noqa: SIM115
                if job.stderr_file
                else None
            )
            process = subprocess.Popen(
                job.command(),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=stdout[job.stdout],
                stderr=stderr,
                start_new_session=job.new_session,
            )
        if job.cores is not None:
            with contextlib.suppress(psutil.Error, AttributeError):
                psutil.Process(process.pid).cpu_affinity(list(job.cores))
        child = Child(job, process, token)
        with self._lock:
            self._children[token] = child
        threading.Thread(target=self._wait_exit, args=(child,), daemon=True).start()
        return child

    def _emit(self, child: Child, event: ProcessEvent) -> None:
        try:
            self._on_event(child, event)
        except Exception:  # an owner's bug must not silence the supervisor
            log.exception("%s: handling %s failed", child.name, event.kind)

    def _on_channel(self, channel: Channel[Any]) -> None:
        first = channel.recv()
        child = None
        if isinstance(first, ChildHello):
            with self._lock:
                child = self._children.get(first.child)
        if child is None or child.channel is not None:
            log.warning("supervisor: unexpected connection (%s)", first)
            channel.close()
            return
        child.channel = channel
        try:
            self._set_state(child, "connected")
            self._emit(child, Connected(child=child.name))
            self._read(child, channel)
        finally:
            child.heard_all.set()

    def _read(self, child: Child, channel: Channel[Any]) -> None:
        while (message := channel.recv()) is not None:
            child.last_heard = time.monotonic()
            if isinstance(message, ChildHeartbeat):
                last = child.heartbeat
                if last is None or message.steps != last.steps or not message.busy:
                    child.progressed = time.monotonic()
                child.heartbeat = message
                self._emit(child, Heartbeat(child=child.name, message=message))
            elif isinstance(message, ChildPhase):
                child.phase = message.phase
                self._emit(child, PhaseChanged(child=child.name, phase=message.phase))
            elif isinstance(message, ChildReady):
                child.ready = message
                child.progressed = time.monotonic()
                self._set_state(child, "ready")
                self._emit(child, Ready(child=child.name, message=message))
            elif isinstance(message, ChildResult):
                child.result = message
                self._emit(child, Finished(child=child.name, message=message))
            elif isinstance(message, ChildFailed):
                child.reported = message.message
                child.error = f"failed: {message.message}"

    def _set_state(self, child: Child, state: ChildState) -> None:
        if child.state != "exited":
            child.state = state

    def _wait_exit(self, child: Child) -> None:
        code = child.process.wait()
        if child.channel is not None:  # its last words (why it failed) come first
            child.heard_all.wait(LAST_WORDS_SECONDS)
        child.state = "exited"
        try:
            if child.stopping:
                return
            event = _exit_event(child, code)
            if isinstance(event, Failed):
                child.error = child.error or event.message
            self._emit(child, event)
        finally:
            child.gone.set()

    def _watch(self) -> None:
        while not self._closed.wait(1.0):
            now = time.monotonic()
            with self._lock:
                children = list(self._children.values())
            for child in children:
                limit = child.job.stall_timeout
                if limit is None or child.state != "ready" or child.stalled is not None:
                    continue
                busy = child.heartbeat is not None and child.heartbeat.busy
                if now - child.last_heard > limit:
                    child.stalled = "frozen"
                    child.error = f"made no progress for {limit:g}s (no heartbeat: frozen?)"
                elif busy and now - child.progressed > 2 * limit:
                    # later than "frozen": the peers of a frozen child get stuck waiting on
                    # it, and the frozen one is the culprit to report
                    child.stalled = "stuck"
                    child.error = f"made no progress for {2 * limit:g}s (waiting on a peer)"
                else:
                    continue
                stalled = Failed(
                    child=child.name, reason="stall", message=child.error, stall=child.stalled
                )
                self._emit(child, stalled)

    def stop(self, child: Child, grace: float = 0.0) -> None:
        """Stop ``child``: SIGTERM and ``grace`` seconds to finish, else (or at once) SIGKILL
        (a rank may be spinning in a collective of a broken ring); remove its folder."""
        child.stopping = True
        if child.channel is not None:
            child.channel.close()
        if child.process.poll() is None:
            if grace > 0:
                child.process.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.process.wait(grace)
            if child.process.poll() is None:
                child.process.kill()
        child.process.wait()
        child.state = "exited"
        if child.job.folder:
            shutil.rmtree(child.job.folder, ignore_errors=True)
        with self._lock:
            self._children.pop(child.token, None)

    def stop_all(self, grace: float = 0.0) -> None:
        """`stop` every child, the SIGTERMs all sent before any wait."""
        with self._lock:
            children = list(self._children.values())
        for child in children:
            child.stopping = True
            if grace > 0 and child.process.poll() is None:
                child.process.terminate()
        deadline = time.monotonic() + grace
        for child in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(max(0.0, deadline - time.monotonic()))
            self.stop(child)

    def close(self, grace: float = 0.0) -> None:
        self._closed.set()
        self.stop_all(grace)
        self._listener.close()


def _exit_event(child: Child, code: int) -> Failed | Exited:
    name = child.name
    if child.reported is not None:
        return Failed(child=name, reason="error", message=f"failed: {child.reported}", code=code)
    if code < 0:
        return Failed(
            child=name,
            reason="signal",
            message=f"exited with code {code}: killed by signal {_signal_name(-code)}",
            signal=-code,
        )
    if code > 0:
        return Failed(child=name, reason="exit", message=f"exited with code {code}", code=code)
    return Exited(child=name)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
