"""Speculative decoding against plain decoding on 2 uneven local ranks, on an edit task:
return a source file with one function renamed (most of the answer repeats the prompt, which is
where drafts looked up in it are accepted). Three contenders a round, in one run:
- plain decoding;
- prompt lookup (drafts from the prompt and the text so far);
- a draft model (--draft-model, by default the default model's 4-bit file drafting for its
  float32 file; --draft-drafts tokens a step).

Rounds alternate between them so drift on a noisy machine hits all alike; medians are
reported, with the acceptance rates (accepted drafts / drafted tokens) and whether all gave
the same tokens (greedy: they must).

Under load: `exo-tp run --local-nodes 2` with and without prompt-lookup drafts asked of every
request, 8 concurrent streaming clients (--streams) on distinct prompts: aggregate tokens/s
(speculation must not make it worse: by default it turns itself off while more than one
stream runs), and with `--batch-drafts on` (every stream drafts, all verified in one step).

    python bench/speculative.py [--model smollm2-135m] [--lines 200] [--tokens 256]
        [--drafts 4] [--ngram 3] [--draft-model smollm2-135m-q4] [--draft-drafts 3]
        [--weights 0.6,0.4] [--rounds 3] [--quick]

``--quick``: 1 round, a 12-line file, 16 tokens, on a tiny random model with SmolLM2's tokenizer
(bench/_common.py's ``tiny_model``), drafting for itself, unless --model is given (its random
answers seldom repeat the prompt: drafts are looked up and verified, few accepted;
tests/cluster/test_speculative.py holds accepted drafts exact).

``--mtp``: the checkpoint's own MTP heads against plain decoding instead, at 1 stream and
under load, on a Qwen 3.5-shaped random model whose heads are first trained on its own text
(bench/_mtp.py; ``--mtp-drafts``, ``--train-steps``).

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

CONTENDERS = ("plain", "prompt_lookup", "draft_model")
DRAFT_MODEL = "smollm2-135m-q4"  # the default model's 4-bit file drafting for its float32 one


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


def run(
    model: Path, args: argparse.Namespace, drafts: int, report: Path, draft_model: str = ""
) -> LaunchReport:
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
    if draft_model:
        command += ["--draft-model", draft_model]
    done = subprocess.run(command, env=env(), capture_output=True, text=True)
    if done.returncode != 0:  # the launch's own one-line error, or its ranks' logs
        sys.exit(f"exo-tp launch failed:\n{done.stderr[-3000:]}")
    return launch_report(report)


def under_load(model: Path, args: argparse.Namespace, logs: Path) -> dict[str, float]:
    """Aggregate tokens/s of ``args.streams`` concurrent streams on a 2-node local cluster,
    requests drafting ``args.drafts`` tokens a step (the node's default) and not drafting
    (medians of ``args.rounds`` alternating runs: one run's aggregate swings by 2x here)."""
    from serving import aggregate_under_load

    def aggregate(drafts: int, batched: str = "off") -> float:
        extra = ("--weights", args.weights, "--num-draft-tokens", str(drafts))
        extra += ("--batch-drafts", batched)
        name = f"drafts-{drafts}-{batched}"
        return aggregate_under_load(name, str(model), logs, extra, args.streams, args.load_tokens)

    runs: dict[str, list[float]] = {"plain": [], "drafting": [], "batched": []}
    for _ in range(args.rounds):  # alternating, as the rounds above
        runs["plain"].append(aggregate(0))
        runs["drafting"].append(aggregate(args.drafts))
        runs["batched"].append(aggregate(args.drafts, "on"))
    plain, drafting = statistics.median(runs["plain"]), statistics.median(runs["drafting"])
    batched = statistics.median(runs["batched"])
    return {
        "plain_tps": round(plain, 3),
        "drafting_tps": round(drafting, 3),
        "drafting_over_plain": round(drafting / plain, 3) if plain else 0.0,
        "batched_tps": round(batched, 3),
        "batched_over_plain": round(batched / plain, 3) if plain else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help=MODEL_HELP)
    parser.add_argument("--lines", type=int, default=200, help="lines of the file to edit")
    parser.add_argument("--tokens", type=int, default=256, help="tokens generated at most")
    parser.add_argument("--drafts", type=int, default=4, help="--num-draft-tokens")
    parser.add_argument("--ngram", type=int, default=3, help="--prompt-lookup-ngram")
    parser.add_argument(
        "--draft-model", help="the draft model (default: the 4-bit default model; --quick: itself)"
    )
    parser.add_argument("--draft-drafts", type=int, default=3, help="its drafts per step")
    parser.add_argument("--weights", default="0.6,0.4")
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams under load")
    parser.add_argument("--load-tokens", type=int, default=64, help="tokens each, under load")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 1 round, a 12-line file, 16 tokens"
    )
    parser.add_argument(
        "--mtp",
        action="store_true",
        help="instead: the checkpoint's own MTP heads against plain decoding (bench/_mtp.py)",
    )
    parser.add_argument("--mtp-drafts", type=int, default=3, help="--mtp: drafts a step")
    parser.add_argument("--train-steps", type=int, default=300, help="--mtp: heads' training")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.lines, args.tokens, args.load_tokens = 1, 12, 16, 8
        args.train_steps = min(args.train_steps, 20)
    if args.mtp:
        from _mtp import run_mtp

        with tempfile.TemporaryDirectory() as tmp:
            run_mtp(args, Path(tmp))
        return
    model = model_folder(args.model, args.quick)
    draft = args.draft_model or (str(model) if args.quick or args.model else DRAFT_MODEL)
    tps: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    rates: dict[str, list[float]] = {name: [] for name in CONTENDERS[1:]}
    same = True
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            reports = {
                "plain": run(model, args, 0, Path(tmp) / "plain.json"),
                "prompt_lookup": run(model, args, args.drafts, Path(tmp) / "lookup.json"),
                "draft_model": run(model, args, args.draft_drafts, Path(tmp) / "draft.json", draft),
            }
            for name, report in reports.items():
                tps[name].append(report.generation_tps)
                if name in rates:
                    drafted = report.drafted_tokens
                    rates[name].append(report.accepted_tokens / drafted if drafted else 0.0)
            same = same and len({r.tokens for r in reports.values()}) == 1
            print(
                f"round {round_ + 1}: "
                + ", ".join(
                    f"{name} {r.generation_tps:.2f} tok/s ({r.accepted_tokens}/"
                    f"{r.drafted_tokens} drafts kept)"
                    for name, r in reports.items()
                ),
                file=sys.stderr,
            )
        load = under_load(model, args, Path(tmp))
    print(
        f"under load, {args.streams} streams: plain {load['plain_tps']:.2f} tok/s, drafting "
        f"{load['drafting_tps']:.2f} tok/s (a lone stream), {load['batched_tps']:.2f} tok/s "
        "(drafts inside the batch)",
        file=sys.stderr,
    )
    median = {k: statistics.median(v) for k, v in tps.items()}
    ratio = {name: median[name] / median["plain"] if median["plain"] else 0.0 for name in rates}
    acceptance = {name: statistics.median(v) for name, v in rates.items()}
    print(
        f"model {model_name(args.model, args.quick)}, 2 ranks {args.weights}, "
        f"a {args.lines}-line file, {args.tokens} tokens, median of {args.rounds} rounds; "
        f"prompt lookup: {args.drafts} drafts, n-gram {args.ngram}; draft model "
        f"{args.draft_model or ('itself' if args.quick or args.model else DRAFT_MODEL)}: "
        f"{args.draft_drafts} drafts"
    )
    for name in CONTENDERS:
        extra = (
            f", {ratio[name]:.2f}x plain, acceptance {acceptance[name]:.2f}"
            if name in ratio
            else ""
        )
        print(f"{name}: {median[name]:.2f} tok/s{extra}")
    print(f"same tokens: {same}")
    print(
        f"under load, {args.streams} streams: drafting / plain "
        f"{load['drafting_over_plain']:.2f}x aggregate, drafts inside the batch / plain "
        f"{load['batched_over_plain']:.2f}x"
    )
    print(
        json.dumps(
            {
                "plain_tps": round(median["plain"], 3),
                "prompt_lookup_tps": round(median["prompt_lookup"], 3),
                "draft_model_tps": round(median["draft_model"], 3),
                "prompt_lookup_over_plain": round(ratio["prompt_lookup"], 3),
                "draft_model_over_plain": round(ratio["draft_model"], 3),
                "prompt_lookup_acceptance": round(acceptance["prompt_lookup"], 3),
                "draft_model_acceptance": round(acceptance["draft_model"], 3),
                "same_tokens": same,
                "under_load_streams": args.streams,
                "under_load_drafting_over_plain": load["drafting_over_plain"],
                "under_load_batched_drafts_over_plain": load["batched_over_plain"],
            }
        )
    )


if __name__ == "__main__":
    main()
