"""MLX's bundled BLAS against the system's OpenBLAS (preloaded by `exo-tp`, exo_tp/process/blas.py),
side by side in one run: prefill and decode tokens/s of single-device mlx-lm and of `exo-tp
launch` on 2 ranks, each under ``EXO_TP_BLAS=bundled`` and ``auto``, alternating, median of
``--rounds``. Last line: JSON with every figure and the OpenBLAS / bundled ratios.

    python bench/blas.py [--rounds 3] [--prompt-tokens 700] [--tokens 64] [--quick]

``--quick``: a smoke run (1 round, a prompt of 2 lines, 4 tokens, a tiny random model with
SmolLM2's tokenizer (bench/_common.py's ``tiny_model``) unless --model is given); it measures
nothing worth reporting."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import MODEL_HELP, ROOT, env, launch_command, launch_report, mlx_lm_alone, model_folder

sys.path.insert(0, str(ROOT))
from exo_tp.process.blas import blas_library  # noqa: E402


def _prompt(tokens: int) -> str:
    # Short distinct lines of code, about 11 tokens each (the agentic case: a file in context).
    return "\n".join(f"def f{i}(x): return x * {i}" for i in range(max(1, tokens // 11)))


def _single(model: Path, prompt: str, tokens: int, blas: str) -> dict[str, float]:
    speed = mlx_lm_alone(model, tokens, prompt, blas)
    return {"prefill": speed.prompt_tps, "decode": speed.generation_tps}


def _exo_tp(model: Path, prompt: str, tokens: int, blas: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        command = launch_command(model, [1, 1], tokens, report)
        command[command.index("--prompt") + 1] = prompt
        subprocess.run(
            command,
            capture_output=True,
            text=True,
            check=True,
            env=env(blas),
        )
        stats = launch_report(report)
        return {"prefill": stats.prompt_tps, "decode": stats.generation_tps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help=MODEL_HELP)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=700)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="a smoke run (tiny settings)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.prompt_tokens, args.tokens = 1, 22, 4
    library = blas_library(os.environ.get("EXO_TP_BLAS"))
    if library is None:
        raise SystemExit("no OpenBLAS to compare with (apt-get install libopenblas0-pthread)")
    model, prompt = model_folder(args.model, args.quick), _prompt(args.prompt_tokens)
    runs: dict[str, list[dict[str, float]]] = {}
    for round_ in range(args.rounds):
        for who, run in (("mlx_lm", _single), ("exo_tp_2_ranks", _exo_tp)):
            for blas in ("bundled", "auto"):
                figures = run(model, prompt, args.tokens, blas)
                runs.setdefault(f"{who}/{blas}", []).append(figures)
                print(
                    f"round {round_ + 1} {who:<15} {blas:<8} prefill {figures['prefill']:7.1f}"
                    f" tok/s  decode {figures['decode']:6.2f} tok/s",
                    flush=True,
                )
    median = {
        name: {k: statistics.median(r[k] for r in rows) for k in ("prefill", "decode")}
        for name, rows in runs.items()
    }
    ratios = {
        f"{who}_{kind}_openblas_over_bundled": median[f"{who}/auto"][kind]
        / median[f"{who}/bundled"][kind]
        for who in ("mlx_lm", "exo_tp_2_ranks")
        for kind in ("prefill", "decode")
    }
    print(json.dumps({"openblas": library, "median_tok_s": median, **ratios}))


if __name__ == "__main__":
    main()
