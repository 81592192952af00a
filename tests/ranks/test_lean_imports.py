"""exo-tp's own processes leave trio out (httpcore2 would import it for an event loop they
never run); a program importing exo_tp as a library keeps it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from exo_tp.process.lean_imports import own_process

PY = "/usr/bin/python3"


@pytest.mark.parametrize(
    ("argv", "own"),
    [
        ([PY, "-m", "exo_tp.runtime.rank", "job.json"], True),
        ([PY, "-X", "importtime", "-u", "-m", "exo_tp", "run"], True),
        ([PY, "/usr/local/bin/exo-tp", "launch", "-m", "x"], True),
        ([PY, "-m", "pytest", "-m", "exo_tp"], False),
        ([PY, "bench/serving.py", "-m", "exo_tp"], False),
        ([PY, "-c", "import exo_tp", "-m", "exo_tp"], False),
        ([PY], False),
    ],
)
def test_which_command_lines_are_exo_tps_own(argv: list[str], own: bool) -> None:
    assert own_process(argv) is own


CHECK = "import exo_tp, httpcore2._synchronization as s; print(s.trio is not None)"


@pytest.mark.skipif(importlib.util.find_spec("trio") is None, reason="trio is not installed")
def test_trio_is_left_out_only_in_exo_tps_own_processes() -> None:
    library = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True)
    assert library.stdout.strip() == "True", library.stderr  # a library user keeps trio
    own = subprocess.run(
        [sys.executable, "-m", "exo_tp.process.lean_imports"], capture_output=True, text=True
    )
    assert own.stdout.strip() == "trio: left out", own.stderr
