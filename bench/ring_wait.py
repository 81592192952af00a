"""Decode speed of local ranks whose ring waits sleep (exo-tp's default) against ranks that spin
(MLX as it is, ``EXO_TP_RING_WAIT=spin``), side by side in one run.

Each round runs `exo-tp launch` once per (rank count, wait) in alternating order, on the default
model in float32; the figure is the launch report's decode tokens/s. With more ranks than cores
a spinning rank takes the core from the rank it waits for; with one rank per core the sleeping
waits must cost nothing measurable.

    python bench/ring_wait.py [--ranks 2,3] [--tokens 48] [--rounds 3] [--quick]

``--quick``: 2 ranks, 4 tokens, one round, a tiny random model with SmolLM2's tokenizer
(bench/_common.py's ``tiny_model``) unless --model is given; it measures nothing worth
reporting. The last line of stdout is one JSON object: the median tokens/s of each and sleep's
ratio to spin."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

from _common import MODEL_HELP, env, generation_tps, launch_command, model_folder

WAITS = ("spin", "sleep")


def decode_tps(model: Path, ranks: int, tokens: int, wait: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        weights = [1.0] * ranks
        subprocess.run(
            launch_command(model, weights, tokens, report, "--dtype", "float32", "--temp", "0"),
            capture_output=True,
            text=True,
            check=True,
            env={**env(), "EXO_TP_RING_WAIT": wait},
        )
        return generation_tps(report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help=MODEL_HELP)
    parser.add_argument("--ranks", default="2,3", help="rank counts, comma-separated")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smoke run (tiny settings)")
    args = parser.parse_args()
    if args.quick:  # 2 ranks: 3 spinning ranks on a 2-core machine wait out each other's slices
        args.ranks, args.tokens, args.rounds = "2", 4, 1
    model = model_folder(args.model, args.quick)
    counts = [int(n) for n in args.ranks.split(",")]
    seen: dict[tuple[int, str], list[float]] = {(n, w): [] for n in counts for w in WAITS}
    for round_index in range(args.rounds):
        for n in counts:
            # alternate which goes first, so that a drift in the machine's load hits both
            for wait in WAITS if round_index % 2 == 0 else WAITS[::-1]:
                seen[n, wait].append(decode_tps(model, n, args.tokens, wait))
    headline: dict[str, object] = {"tokens": args.tokens, "rounds": args.rounds}
    print(f"{'ranks':>5}  {'spin tok/s':>10}  {'sleep tok/s':>11}  sleep/spin")
    for n in counts:
        spin, sleep = (statistics.median(seen[n, w]) for w in WAITS)
        print(f"{n:>5}  {spin:>10.2f}  {sleep:>11.2f}  {sleep / spin:>10.2f}")
        headline[f"ranks_{n}"] = {"spin_tps": spin, "sleep_tps": sleep, "ratio": sleep / spin}
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
