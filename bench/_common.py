"""Helpers shared by the bench scripts: run mlx-lm alone or exo-tp, in fresh processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from exo_tp.runtime.launcher import LaunchReport

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Once upon a time, in a village at the edge of a great forest, there lived"

_SINGLE = """
import json, sys, mlx.core as mx
from mlx_lm import load, stream_generate
model, tok = load(sys.argv[1]); model.set_dtype(mx.float32)
ids = tok.encode(sys.argv[2])
for r in stream_generate(model, tok, mx.array(ids), max_tokens=int(sys.argv[3])): pass
print(json.dumps({"tps": r.generation_tps, "tokens": r.generation_tokens}))
"""


def env(blas: str | None = None) -> dict[str, str]:
    """The environment with this checkout first on PYTHONPATH (workers import exo_tp), and the
    BLAS that `exo-tp` preloads (``EXO_TP_BLAS``, or ``blas`` if given) preloaded for every
    contender alike: mlx-lm baselines multiply with the same library as exo-tp's ranks."""
    sys.path.insert(0, str(ROOT))
    from exo_tp.process.blas import BLAS_ENV, preload_environment

    chosen = {**os.environ, BLAS_ENV: blas} if blas else None
    return {
        **preload_environment(chosen),
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }


def pinned(core: int):  # noqa: ANN201 (a preexec_fn)
    """A ``preexec_fn`` that pins the child process to ``core``."""
    return lambda: os.sched_setaffinity(0, [core])


def single_process_tps(model: Path, tokens: int) -> float:
    """Decode tokens/s of plain mlx-lm in one process (float32, greedy)."""
    out = subprocess.run(
        [sys.executable, "-c", _SINGLE, str(model), PROMPT, str(tokens)],
        capture_output=True,
        text=True,
        check=True,
        env=env(),
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["tps"]


def launch_command(
    model: Path, weights: list[float], tokens: int, report: Path, *extra: str
) -> list[str]:
    """`exo-tp launch` of the bench prompt on len(weights) local ranks, stats to ``report``."""
    return [
        sys.executable,
        "-m",
        "exo_tp",
        "launch",
        "--ranks",
        str(len(weights)),
        "--weights",
        ",".join(map(str, weights)),
        "--model",
        str(model),
        "--prompt",
        PROMPT,
        "--ignore-chat-template",
        "--max-tokens",
        str(tokens),
        "--report-out",
        str(report),
        *extra,
    ]


def launch_report(report: Path) -> LaunchReport:
    """An `exo-tp launch --report-out` file."""
    sys.path.insert(0, str(ROOT))
    from exo_tp.runtime.launcher import LaunchReport

    return LaunchReport.model_validate_json(report.read_text())


def generation_tps(report: Path) -> float:
    return launch_report(report).generation_tps


def exo_tp_tps(model: Path, weights: list[float], tokens: int, *extra: str) -> float:
    """Decode tokens/s of `exo-tp launch` on len(weights) local ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run(
            launch_command(model, weights, tokens, report, *extra),
            capture_output=True,
            text=True,
            check=True,
            env=env(),
        )
        return generation_tps(report)


def resolve(model: str) -> Path:
    sys.path.insert(0, str(ROOT))
    from exo_tp.models.registry import resolve_model

    return resolve_model(model)
