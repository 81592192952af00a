"""The test modules' share of the machine under pytest-xdist: most modules run beside another
worker's, a module marked ``alone`` with none beside it.

A shared/exclusive lock over every worker, ``flock`` on a file in the run's temporary folder
(each worker's own folder is inside it), with a turnstile so that an exclusive waiter is not
starved: the other worker cannot start its next module while one waits to be alone (Linux's
flock grants a shared lock to whoever asks while an exclusive one waits).

Every ``alone`` module goes to one worker as one unit of work (`AloneTogether`), which keeps
the exclusive lock from the first of them to the last (`MachineShare`): the other worker
then finishes its module once for all of them, rather than once for each (a wait of the
length of that module's rest, nine times in a run).
"""

from __future__ import annotations

import contextlib
import fcntl
import re
from collections.abc import Iterator
from pathlib import Path

from xdist.scheduler import LoadFileScheduling

ALONE_SCOPE = "machine-share: the alone modules"
_MARKED = re.compile(r"^\s*(pytestmark = )?pytest\.mark\.alone\b", re.MULTILINE)


def alone_modules(tests: Path) -> frozenset[str]:
    """The test files (relative to the repository, as node ids start) marked ``alone``."""
    root = tests.parent
    return frozenset(
        str(path.relative_to(root))
        for path in tests.rglob("test_*.py")
        if _MARKED.search(path.read_text(encoding="utf-8"))
    )


class AloneTogether(LoadFileScheduling):
    """pytest-xdist's ``loadfile``, with every ``alone`` module in one unit of work."""

    alone: frozenset[str] = frozenset()

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return ALONE_SCOPE if path in self.alone else path


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


class MachineShare:
    """A worker's hold on the machine: shared for each ordinary module; exclusive from its
    first ``alone`` module until the next ordinary one (or the end), so that consecutive
    ``alone`` modules keep it between them."""

    def __init__(self, run_folder: Path):
        self._run_folder = run_folder
        self._alone: contextlib.ExitStack | None = None

    @contextlib.contextmanager
    def module(self, alone: bool) -> Iterator[None]:
        if alone:
            if self._alone is None:
                stack = contextlib.ExitStack()
                stack.enter_context(machine_lock(self._run_folder, alone=True))
                self._alone = stack
            yield
            return
        self.release()
        with machine_lock(self._run_folder, alone=False):
            yield

    def release(self) -> None:
        if self._alone is not None:
            stack, self._alone = self._alone, None
            stack.close()
