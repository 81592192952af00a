"""Every bench script's ``--quick`` run: it exits 0, its last line of stdout is a JSON object,
and it leaves no process behind.

The bench scripts reach deep into exo_tp (workers, plans, node views), and nothing else runs
them: a refactor that breaks one shows only when someone next measures, as a traceback after a
long run. Each ``--quick`` is the smallest run that still takes every path of its script
(docs/benchmarks.md); the numbers it prints mean nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from exo_tp.process.blas import blas_library, usable_cores
from exo_tp.transport.ring_wait import WAIT_ENV

pytestmark = pytest.mark.alone  # under pytest-xdist: it runs two scripts at a time

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if not p.name.startswith("_"))
# Every process a case starts carries this variable, whatever session or parent it ends up
# with: the bench scripts start nodes in sessions of their own, which a timeout does not reach.
TAG_ENV = "EXO_TP_BENCH_QUICK_TAG"
# Seconds a case may take: about three times its quick run on a 2-core machine under load
# (2026-12-03, tiny models and a shared MLX kernel cache: serving 52 s, hetero_lab 65, reshard
# 41, finetune 26, every other case under 25).
TIMEOUT = {"serving": 300, "hetero_lab": 300, "reshard": 300, "finetune": 180}
GRACE = 15.0  # seconds a script's processes may take to exit after it did (SIGTERM handlers)
# Cases run two at a time: a quick run is mostly process starts (imports, one core each) and
# waits on them. hetero_lab runs alone: it pins its two emulated devices to the two cores.
SLOTS = 2
WHOLE_MACHINE = {"hetero_lab"}


def _tagged(tag: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(TAG_ENV) == tag and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


def _left_behind(tag: str) -> list[str]:
    """The case's processes still running after ``GRACE`` (killed, so that they do not slow
    down the cases after this one), as their command lines."""
    deadline = time.monotonic() + GRACE
    while (alive := _tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = []
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            left.append(" ".join(proc.cmdline())[:200])
            proc.kill()
    return left


def _skip_reason(script: str) -> str | None:
    if script == "blas" and blas_library(None) is None:
        return "no system OpenBLAS to compare MLX's bundled BLAS with"
    if script == "hetero_lab" and usable_cores() < 2:
        return "the lab pins its two devices to two cores"
    return None


@dataclass(frozen=True)
class QuickRun:
    done: subprocess.CompletedProcess[str]
    left: list[str]  # its processes still running after GRACE (killed)


def _quick_run(script: str, tmp_path: Path, default_models: dict[str, Path]) -> QuickRun:
    # A cache of its own (device profiles, manifests), sharing the prepared models.
    home = tmp_path / "exo-tp-home"
    home.mkdir()
    (home / "models").symlink_to(default_models["smollm2-135m"].parent, target_is_directory=True)
    # Temporary files in the case's folder, but MLX's CPU kernels compiled once per machine:
    # MLX keeps them in $TMPDIR/mlx, and a fresh one made every process of every case compile
    # each fused kernel again with the C++ compiler (finetune_adam_noise: 12 s -> 45 s).
    kernels = Path(tempfile.gettempdir()) / "mlx"
    kernels.mkdir(exist_ok=True)
    (tmp_path / "mlx").symlink_to(kernels, target_is_directory=True)
    tag = secrets.token_hex(8)
    env = {
        **os.environ,
        TAG_ENV: tag,
        "EXO_TP_HOME": str(home),
        "TMPDIR": str(tmp_path),
        # Two cases share the cores: ranks that spin while they wait would take them from the
        # other case's processes (a script that compares waits sets its own).
        WAIT_ENV: "sleep",
    }
    try:
        done = subprocess.run(
            [sys.executable, str(BENCH / f"{script}.py"), "--quick"],
            capture_output=True,
            text=True,
            timeout=TIMEOUT.get(script, 180),
            env=env,
            cwd=tmp_path,
        )
    finally:
        left = _left_behind(tag)
    return QuickRun(done, left)


@pytest.fixture(scope="module")
def quick_runs(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    default_models: dict[str, Path],
) -> Iterator[dict[str, Future[QuickRun]]]:
    """The selected cases' runs, started at once, ``SLOTS`` at a time, in the order the tests
    read them. The cases that need the whole machine run first, alone."""
    selected = {
        item.callspec.params["script"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    }
    scripts = [s for s in SCRIPTS if s in selected and _skip_reason(s) is None]
    alone = [s for s in scripts if s in WHOLE_MACHINE]
    with ThreadPoolExecutor(SLOTS) as pool:

        def run(script: str) -> QuickRun:
            if script not in WHOLE_MACHINE:
                wait([runs[s] for s in alone])
            return _quick_run(script, tmp_path_factory.mktemp(script), default_models)

        runs: dict[str, Future[QuickRun]] = {}
        for script in [*alone, *(s for s in scripts if s not in WHOLE_MACHINE)]:
            runs[script] = pool.submit(run, script)
        yield runs


@pytest.mark.parametrize("script", SCRIPTS)
def test_quick_run(script: str, quick_runs: dict[str, Future[QuickRun]]) -> None:
    if reason := _skip_reason(script):
        pytest.skip(reason)
    run = quick_runs[script].result()  # raises what the run raised (its timeout)
    done, left = run.done, run.left
    assert done.returncode == 0, f"bench/{script}.py --quick failed:\n{done.stderr[-4000:]}"
    lines = done.stdout.strip().splitlines()
    assert lines, f"bench/{script}.py --quick printed nothing"
    assert isinstance(json.loads(lines[-1]), dict), lines[-1][:500]
    assert not left, f"bench/{script}.py --quick left processes behind: {left}"
