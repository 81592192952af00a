"""The test modules' share of the machine under pytest-xdist: most modules run beside another
worker's, a module marked ``alone`` with none beside it.

A shared/exclusive lock over every worker, ``flock`` on a file in the run's temporary folder
(each worker's own folder is inside it), with a turnstile so that an exclusive waiter is not
starved: the other worker cannot start its next module while one waits to be alone (Linux's
flock grants a shared lock to whoever asks while an exclusive one waits).
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def machine_lock(run_folder: Path, alone: bool) -> Iterator[None]:
    with (
        (run_folder / "machine.turnstile").open("a") as turnstile,
        (run_folder / "machine.lock").open("a") as machine,
    ):
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        fcntl.flock(machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
