"""Prompt-lookup speculative decoding against plain decoding on 2 uneven local ranks, on an
edit task: return a source file with one function renamed (most of the answer repeats the
prompt, which is where drafts looked up in it are accepted).

Rounds alternate between the two so drift on a noisy machine hits both alike; medians are
reported, with the acceptance rate (accepted drafts / drafted tokens) and whether both gave
the same tokens (greedy: they must).

    python bench/speculative.py [--model smollm2-135m] [--lines 200] [--tokens 256]
        [--drafts 4] [--ngram 3] [--weights 0.6,0.4] [--rounds 3] [--quick]

``--quick``: 1 round, a 12-line file, 16 tokens, on a tiny random model with SmolLM2's tokenizer
(bench/_common.py's ``tiny_model``) unless --model is given (its random answers seldom repeat
the prompt: drafts are looked up and verified, few accepted; tests/test_speculative.py holds
accepted drafts exact).

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from _common import MODEL_HELP, env, launch_report, model_folder, model_name

if TYPE_CHECKING:
    from exo_tp.runtime.launcher import LaunchReport


def source_file(lines: int) -> str:
    """A plain Python module of about ``lines`` lines: small functions, one of them
    ``compute_total``, which the others call (the name the task renames)."""
    out = ['"""Order bookkeeping."""', "", ""]
    out += ["def compute_total(prices, quantities):", "    total = 0"]
    out += ["    for price, count in zip(prices, quantities):", "        total += price * count"]
    out += ["    return total", "", ""]
    index = 0
    while len(out) < lines:
        out += [
            f"def order_{index}_summary(prices, quantities, discount={index % 5}):",
            f'    """Summary of order {index}, with its discount in percent."""',
            "    total = compute_total(prices, quantities)",
            "    return total * (100 - discount) / 100",
            "",
            "",
        ]
        index += 1
    return "\n".join(out[:lines]) + "\n"


def prompt(lines: int) -> str:
    return (
        "Rename the function compute_total to sum_order in this file, including where it is "
        "called. Reply with the whole file and nothing else.\n\n" + source_file(lines)
    )


def run(model: Path, args: argparse.Namespace, drafts: int, report: Path) -> LaunchReport:
    command = [
        sys.executable,
        "-m",
        "exo_tp",
        "launch",
        "--ranks",
        "2",
        "--weights",
        args.weights,
        "--model",
        str(model),
        "--prompt",
        prompt(args.lines),
        "--max-tokens",
        str(args.tokens),
        "--num-draft-tokens",
        str(drafts),
        "--prompt-lookup-ngram",
        str(args.ngram),
        "--report-out",
        str(report),
    ]
    done = subprocess.run(command, env=env(), capture_output=True, text=True)
    if done.returncode != 0:  # the launch's own one-line error, or its ranks' logs
        sys.exit(f"exo-tp launch failed:\n{done.stderr[-3000:]}")
    return launch_report(report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help=MODEL_HELP)
    parser.add_argument("--lines", type=int, default=200, help="lines of the file to edit")
    parser.add_argument("--tokens", type=int, default=256, help="tokens generated at most")
    parser.add_argument("--drafts", type=int, default=4, help="--num-draft-tokens")
    parser.add_argument("--ngram", type=int, default=3, help="--prompt-lookup-ngram")
    parser.add_argument("--weights", default="0.6,0.4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 1 round, a 12-line file, 16 tokens"
    )
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.lines, args.tokens = 1, 12, 16
    model = model_folder(args.model, args.quick)
    tps: dict[str, list[float]] = {"plain": [], "speculative": []}
    rates, same = [], True
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            plain = run(model, args, 0, Path(tmp) / "plain.json")
            spec = run(model, args, args.drafts, Path(tmp) / "spec.json")
            tps["plain"].append(plain.generation_tps)
            tps["speculative"].append(spec.generation_tps)
            rates.append(spec.accepted_tokens / spec.drafted_tokens if spec.drafted_tokens else 0)
            same = same and plain.tokens == spec.tokens
            print(
                f"round {round_ + 1}: plain {plain.generation_tps:.2f} tok/s, speculative "
                f"{spec.generation_tps:.2f} tok/s, {spec.accepted_tokens}/"
                f"{spec.drafted_tokens} drafts accepted",
                file=sys.stderr,
            )
    median = {k: statistics.median(v) for k, v in tps.items()}
    ratio = median["speculative"] / median["plain"] if median["plain"] else 0.0
    print(
        f"model {model_name(args.model, args.quick)}, 2 ranks {args.weights}, "
        f"a {args.lines}-line file, "
        f"{args.tokens} tokens, {args.drafts} drafts, n-gram {args.ngram}, "
        f"median of {args.rounds} rounds"
    )
    print(f"plain {median['plain']:.2f} tok/s, speculative {median['speculative']:.2f} tok/s")
    print(f"speculative / plain {ratio:.2f}x, acceptance {statistics.median(rates):.2f}")
    print(f"same tokens: {same}")
    print(
        json.dumps(
            {
                "plain_tps": round(median["plain"], 3),
                "speculative_tps": round(median["speculative"], 3),
                "speculative_over_plain": round(ratio, 3),
                "acceptance": round(statistics.median(rates), 3),
                "same_tokens": same,
            }
        )
    )


if __name__ == "__main__":
    main()
