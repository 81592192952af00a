"""The child's end of `exo_tp.process.supervisor`: find the supervisor in the environment,
say hello, report readiness, heartbeats, a result or why it fails."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil
from pydantic import BaseModel, TypeAdapter

from exo_tp.errors import ExoTpError
from exo_tp.process.messages import Failed, Hello, Ready
from exo_tp.process.supervisor import (
    CHILD_ENV,
    SUPERVISOR_ENV,
    SUPERVISOR_KEY_ENV,
    SUPERVISOR_PID_ENV,
)
from exo_tp.transport.channel import Channel, connect

log = logging.getLogger(__name__)

_NOTHING: TypeAdapter[None] = TypeAdapter(type(None))  # the supervisor never writes
ORPHAN_CHECK_SECONDS = 0.5


class SupervisorLink:
    """This process's link to the supervisor that started it."""

    def __init__(self, channel: Channel[Any], child: str):
        self.channel, self.child = channel, child

    def send(self, message: BaseModel) -> None:
        self.channel.send(message)

    def exit_when_closed(self) -> None:
        """The supervisor closing the link means "stop": exit at once (from a thread)."""

        def wait() -> None:
            self.channel.recv_raw()
            os._exit(0)

        threading.Thread(target=wait, name="supervisor link", daemon=True).start()


def _alive(pid: int) -> bool:
    try:  # a supervisor that died stays a zombie until its own parent reaps it
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def exit_when_orphaned(supervisor_pid: int) -> None:
    """Exit as soon as the supervisor that started this process is gone (it may be a parent
    further up: a job's command can run under a wrapper).

    Its link closing says so too, but only once connected: a child started just before its
    supervisor died would otherwise spend its whole connect timeout retrying a closed port,
    and one killed with its supervisor's process group never hears anything else."""

    def watch() -> None:
        while _alive(supervisor_pid):
            time.sleep(ORPHAN_CHECK_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="orphan watch", daemon=True).start()


def connect_supervisor(timeout: float = 30.0) -> SupervisorLink:
    """Connect to the supervisor named in the environment (and take its variables out of it,
    so nothing this process starts inherits them)."""
    address, key = os.environ.pop(SUPERVISOR_ENV), os.environ.pop(SUPERVISOR_KEY_ENV)
    child = os.environ.pop(CHILD_ENV)
    if supervisor_pid := os.environ.pop(SUPERVISOR_PID_ENV, None):
        exit_when_orphaned(int(supervisor_pid))
    return SupervisorLink(connect(address, bytes.fromhex(key), _NOTHING, timeout), child)


def run_child(main: Callable[[SupervisorLink], None], hello: bool = True) -> None:
    """Run ``main`` as a supervised child with the plain messages: hello first; an ExoTpError
    (or any other exception, logged with its traceback) reported as one line, then exit 1."""
    link = connect_supervisor()
    if hello:
        link.send(Hello(child=link.child))
    try:
        main(link)
    except ExoTpError as error:
        _fail(link, str(error))
    except Exception as error:
        log.exception("failed")
        _fail(link, f"{type(error).__name__}: {error}")
    sys.stdout.flush()
    os._exit(0)  # MLX's ring threads may not end by themselves


def _fail(link: SupervisorLink, message: str) -> None:
    try:
        link.send(Failed(message=message))
    finally:
        sys.stdout.flush()
        os._exit(1)


__all__ = ["Ready", "SupervisorLink", "connect_supervisor", "run_child"]
