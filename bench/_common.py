"""Helpers shared by the bench scripts: run mlx-lm alone or exo-tp, in fresh processes."""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from exo_tp.runtime.launcher import LaunchReport

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PROMPT = "Once upon a time, in a village at the edge of a great forest, there lived"
# A random model in SmolLM2's family (9 query heads in 3 KV groups, tied head, its whole
# 49,152-token vocabulary, chat template and end tokens) at ~1/20 of its compute: SmolLM2-135M
# in float32 takes ~220 ms per decode step on the 2-core VM and ~5 s per 32-row batch step,
# which made the quick runs slow. A quick run's numbers mean nothing, so the quick runs that
# decode take this model (``tiny_model``): the same code paths at a fraction of the compute.
TINY_SMOLLM2 = {
    "hidden_size": 144,
    "head_dim": 16,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
}
# Multiplicative parameters, drawn near 1 (norms; Gemma 4's layer scalars and router scales),
# which near 0 would shrink every layer or flatten the routing into near-ties.
_NEAR_ONE = ("norm.weight", "layer_scalar", "router.scale", "per_expert_scale")


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


def write_model(
    folder: Path,
    source: Path,
    seed: int = 0,
    zero_eos: bool = True,
    bits: int | None = None,
    **changes: Any,
) -> Path:
    """``source``'s config.json changed by ``changes``, random weights from mlx-lm's own
    classes (as mlx-lm holds them, scaled so activations stay O(1)) and ``source``'s tokenizer
    files, in ``folder``. With ``zero_eos`` the end-of-sequence tokens' output rows are zeroed:
    greedy decoding never stops early, so every run decodes all the tokens it asks for. With
    ``bits``, quantized by mlx-lm's own ``quantize_model`` (affine, groups of 32, as the 4-bit
    default model; layers whose input width is not a multiple of 32 stay float).

    The bench scripts' own writer (bench code does not import the test suite's); decode and
    load times do not depend on the weights' values."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes, quantize_model

    config = {**json.loads((source / "config.json").read_text()), **changes}
    folder.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = {
        name: (1.0 if name.endswith(_NEAR_ONE) else 0.0)
        + (0.1 if name.endswith(_NEAR_ONE) else 0.08) * mx.random.normal(value.shape)
        for name, value in tree_flatten(model.parameters())
    }
    if zero_eos:
        head, eos = end_rows(config, weights)
        keep = mx.ones((weights[head].shape[0], 1))
        keep[mx.array(eos)] = 0
        weights[head] = weights[head] * keep
    if bits is not None:
        model.load_weights(list(weights.items()))
        with contextlib.redirect_stdout(io.StringIO()):  # its "[INFO] Quantized ..." line
            model, config = quantize_model(model, config, group_size=32, bits=bits)
        weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    return folder


def end_rows(config: dict[str, Any], weights: dict[str, Any]) -> tuple[str, list[int]]:
    """The output head's name in ``weights`` and the end-of-sequence tokens' rows in it."""
    eos = config.get("eos_token_id", [])
    eos = eos if isinstance(eos, list) else [eos]
    return "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight", eos


def tiny_model(folder: Path, **changes: Any) -> Path:
    """``write_model`` of the default model's config in ``TINY_SMOLLM2``'s shape (``changes``
    on top): what quick runs decode with."""
    return write_model(folder, resolve(DEFAULT_MODEL), **{**TINY_SMOLLM2, **changes})


DEFAULT_MODEL = "smollm2-135m"
MODEL_HELP = f"a model folder or name (default {DEFAULT_MODEL}; --quick: a tiny random model)"


def model_folder(model: str | None, quick: bool) -> Path:
    """The folder of ``--model`` (``model``; ``DEFAULT_MODEL`` if none), or for a quick run
    without one a ``tiny_model`` in a temporary folder, removed when the script exits."""
    if model or not quick:
        return resolve(model or DEFAULT_MODEL)
    folder = Path(tempfile.mkdtemp(prefix="bench-tiny-model-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return tiny_model(folder)


def model_arg(model: str | None, quick: bool) -> str:
    """What a script passes as ``--model``: ``model`` as given; without one, a quick run's
    ``model_folder`` (a tiny model) or ``DEFAULT_MODEL``'s name."""
    if model:
        return model
    return str(model_folder(None, True)) if quick else DEFAULT_MODEL


def model_name(model: str | None, quick: bool) -> str:
    """How a script names ``model_folder``'s model in what it prints."""
    return model or ("a tiny random model" if quick else DEFAULT_MODEL)


def resolve(model: str) -> Path:
    sys.path.insert(0, str(ROOT))
    from exo_tp.models.registry import resolve_model

    return resolve_model(model)
