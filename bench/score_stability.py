"""How stable are `exo-tp bench` scores across repeated runs, and how long does a run take?

Runs the bench ``--runs`` times with ``--quick`` and ``--full-runs`` times in the default mode
(each with ``--refresh`` and a private cache folder), and prints min / median / max and the
relative spread ((max - min) / median) of the decode and prefill scores and the memory bandwidth,
so the planner can use a margin. Also reports each mode's own measured duration and process wall
time (targets: --quick <= 15 s, default <= 60 s on a 2-core machine).

Unless ``--no-decode-check``, it then checks that the decode score predicts real decoding:
single-process mlx-lm (float32) generates with the default models and the measured seconds per
token are compared with the cost model's (`exo_tp.plan.predict`) for a 1-rank plan on the
median quick profile. Run it under the CPU lock on a shared machine:

    flock /tmp/exo-tp-cpu.lock python bench/score_stability.py [--runs 5] [--full-runs 1]
        [--quick]

``--quick``: a smoke run: one quick bench and no default-mode one (which alone takes ~40 s;
the two modes share every line of this script but the flag), and a decode check of 4 tokens,
one run per model, on tiny random models (float32 and 4-bit, bench/_common.py's
``tiny_model``) in place of the default ones; it measures nothing worth reporting.

The last line of stdout is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, single_process_tps, tiny_model

sys.path.insert(0, str(ROOT))

from exo_tp.plan import load_spec, plan_tensor_parallel  # noqa: E402
from exo_tp.plan.cluster import cluster_from_profiles  # noqa: E402
from exo_tp.plan.cost import weight_format  # noqa: E402
from exo_tp.plan.devices import DeviceProfile  # noqa: E402
from exo_tp.plan.pipeline import single_stage  # noqa: E402
from exo_tp.plan.predict import predict  # noqa: E402

METRICS = {  # name -> (profile field, unit scale, unit)
    "decode": ("decode_seconds_per_byte", 1e-10, "1e-10 s/byte"),
    "prefill": ("prefill_flops", 1e9, "GFLOP/s"),
    "memory": ("memory_bandwidth", 1e9, "GB/s"),
    "duration": ("duration_seconds", 1, "s (bench's own)"),
}


def _env(home: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "EXO_TP_HOME": str(home), "PYTHONPATH": path}


def bench_once(quick: bool, home: Path) -> tuple[DeviceProfile, float]:
    command = [
        sys.executable,
        "-m",
        "exo_tp",
        "bench",
        "--refresh",
        "--json",
        *(["--quick"] if quick else []),
    ]
    start = time.perf_counter()
    result = subprocess.run(
        command, capture_output=True, text=True, env=_env(home), cwd=ROOT, check=True
    )
    wall = time.perf_counter() - start
    return DeviceProfile.model_validate_json(result.stdout.strip().splitlines()[-1]), wall


def summary(profiles: list[DeviceProfile], walls: list[float]) -> dict[str, dict[str, float]]:
    out = {}
    for name, (field, _, _) in METRICS.items():
        values = [getattr(p, field) for p in profiles]
        median = statistics.median(values)
        out[name] = {
            "min": min(values),
            "median": median,
            "max": max(values),
            "spread": (max(values) - min(values)) / median,
        }
    out["wall"] = {
        "min": min(walls),
        "median": statistics.median(walls),
        "max": max(walls),
        "spread": (max(walls) - min(walls)) / statistics.median(walls),
    }
    return out


def print_table(title: str, stats: dict[str, dict[str, float]]) -> None:
    print(f"\n{title}")
    print(f"{'metric':<9} {'min':>9} {'median':>9} {'max':>9} {'spread':>8}  unit")
    units = {
        **{k: (scale, unit) for k, (_, scale, unit) in METRICS.items()},
        "wall": (1, "s (process)"),
    }
    for name, s in stats.items():
        scale, unit = units[name]
        print(
            f"{name:<9} {s['min'] / scale:>9.3f} {s['median'] / scale:>9.3f} "
            f"{s['max'] / scale:>9.3f} {s['spread']:>7.1%}  {unit}"
        )


def decode_check(
    profile: DeviceProfile, tokens: int, models: dict[str, Path], runs: int = 2
) -> dict[str, dict[str, float]]:
    """Predicted vs measured single-process decode seconds per token on ``models``."""
    out = {}
    for name, folder in models.items():
        spec = load_spec(folder)
        predicted = predict(
            single_stage(plan_tensor_parallel(spec, [1.0])),
            [0],
            cluster_from_profiles(spec, [profile]),
            context_tokens=tokens,
        ).decode_seconds
        # mlx-lm alone with the BLAS `exo-tp bench` measured with (the one `exo-tp` preloads)
        measured = 1 / max(single_process_tps(folder, tokens) for _ in range(runs))
        out[name] = {
            "predicted_s": predicted,
            "measured_s": measured,
            "predicted_over_measured": predicted / measured,
        }
        print(
            f"{name:<16} predicted {predicted * 1e3:7.1f} ms/token, mlx-lm measured "
            f"{measured * 1e3:7.1f} ms/token ({weight_format(spec)}): "
            f"ratio {predicted / measured:.2f}"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5, help="quick runs (default 5)")
    parser.add_argument("--full-runs", type=int, default=1, help="default-mode runs (default 1)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens for the decode check")
    parser.add_argument("--no-decode-check", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a smoke run (tiny settings)")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.full_runs, args.tokens = 1, 0, 4

    headline: dict[str, object] = {"quick_runs": args.runs, "full_runs": args.full_runs}
    with tempfile.TemporaryDirectory(prefix="exo-tp-stability-") as tmp:
        quick = [bench_once(True, Path(tmp)) for _ in range(args.runs)]
        full = [bench_once(False, Path(tmp)) for _ in range(args.full_runs)]
    q = summary([p for p, _ in quick], [w for _, w in quick])
    print_table(f"--quick, {args.runs} runs", q)
    headline.update(
        {
            "decode_s_per_byte_median": q["decode"]["median"],
            "decode_spread": q["decode"]["spread"],
            "prefill_flops_median": q["prefill"]["median"],
            "prefill_spread": q["prefill"]["spread"],
            "memory_bandwidth_median": q["memory"]["median"],
            "memory_spread": q["memory"]["spread"],
            "quick_seconds_max": q["duration"]["max"],
            "quick_wall_max": q["wall"]["max"],
        }
    )
    if full:
        f = summary([p for p, _ in full], [w for _, w in full])
        print_table(f"default mode, {args.full_runs} runs", f)
        headline.update(
            {
                "full_decode_spread": f["decode"]["spread"],
                "full_prefill_spread": f["prefill"]["spread"],
                "full_seconds_max": f["duration"]["max"],
                "full_wall_max": f["wall"]["max"],
                "full_over_quick_decode": f["decode"]["median"] / q["decode"]["median"],
            }
        )
    if not args.no_decode_check:
        median_profile = sorted((p for p, _ in quick), key=lambda p: p.decode_seconds_per_byte)[
            len(quick) // 2
        ]
        print("\ndecode check (1 process, float32 activations)")
        with tempfile.TemporaryDirectory(prefix="exo-tp-stability-") as tmp:
            models = check_models(args.quick, Path(tmp))
            runs = 1 if args.quick else 2
            headline["decode_check"] = decode_check(median_profile, args.tokens, models, runs)
    print(json.dumps(headline))


def check_models(quick: bool, tmp: Path) -> dict[str, Path]:
    """The decode check's models: the default ones; --quick: tiny random models in their two
    formats (float32 and 4-bit), written in ``tmp`` (SmolLM2's loads and steps were a third of
    the quick run)."""
    from exo_tp.models.registry import DEFAULT_MODELS, resolve_model

    if not quick:
        return {name: resolve_model(name) for name in DEFAULT_MODELS}
    # 128 wide in 8 heads of 16: every projection's input a multiple of the 4-bit groups (32)
    q4 = {"hidden_size": 128, "num_attention_heads": 8, "num_key_value_heads": 2, "bits": 4}
    return {"tiny": tiny_model(tmp / "tiny"), "tiny-q4": tiny_model(tmp / "tiny-q4", **q4)}


if __name__ == "__main__":
    main()
