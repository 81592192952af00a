"""Helpers shared by the bench scripts: run mlx-lm alone or exo-tp, in fresh processes."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from exo_tp.runtime.launcher import LaunchReport

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PROMPT = "Once upon a time, in a village at the edge of a great forest, there lived"


class WorkerResult(BaseModel):
    """What a bench's worker process prints as its last line of stdout: a typed result its
    bench defines (the workers import it: `env` puts the bench folder on their path)."""

    model_config = ConfigDict(frozen=True, extra="forbid")


R = TypeVar("R", bound=WorkerResult)


def worker_result(stdout: str, result: type[R]) -> R:
    """The ``result`` a worker printed on its last line."""
    return result.model_validate_json(stdout.strip().splitlines()[-1])


class MlxLmSpeed(WorkerResult):
    """mlx-lm alone: one prompt, then greedy tokens (``_SINGLE``)."""

    prompt_tps: float
    generation_tps: float
    generation_tokens: int


# mlx-lm alone in one process, float32 as exo-tp's ranks compute on CPU.
_SINGLE = """
import sys, mlx.core as mx
from mlx_lm import load, stream_generate
from _common import MlxLmSpeed
model, tok = load(sys.argv[1]); model.set_dtype(mx.float32)
ids = tok.encode(sys.argv[2])
for r in stream_generate(model, tok, mx.array(ids), max_tokens=int(sys.argv[3])): pass
print(MlxLmSpeed(prompt_tps=r.prompt_tps, generation_tps=r.generation_tps,
                 generation_tokens=r.generation_tokens).model_dump_json())
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
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT), str(BENCH), os.environ.get("PYTHONPATH")) if p
        ),
    }


def pinned(core: int):  # noqa: ANN201 (a preexec_fn)
    """A ``preexec_fn`` that pins the child process to ``core``."""
    return lambda: os.sched_setaffinity(0, [core])


def mlx_lm_alone(
    model: Path, tokens: int, prompt: str = PROMPT, blas: str | None = None
) -> MlxLmSpeed:
    """Plain mlx-lm in a fresh process (float32, greedy): ``prompt``, then ``tokens`` more."""
    out = subprocess.run(
        [sys.executable, "-c", _SINGLE, str(model), prompt, str(tokens)],
        capture_output=True,
        text=True,
        check=True,
        env=env(blas),
    )
    return worker_result(out.stdout, MlxLmSpeed)


def single_process_tps(model: Path, tokens: int) -> float:
    """Decode tokens/s of plain mlx-lm in one process (float32, greedy)."""
    return mlx_lm_alone(model, tokens).generation_tps


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
