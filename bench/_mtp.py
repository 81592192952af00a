"""`bench/speculative.py --mtp`: the checkpoint's own MTP heads (issue #61) against plain
decoding, at 1 stream (`exo-tp launch`, 2 uneven ranks) and under load (`exo-tp run
--local-nodes 2`, 8 streams), on a Qwen 3.5-shaped random model (Gated DeltaNet and gated
attention layers, one MTP layer, SmolLM2's tokenizer).

A random head drafts nothing the model would say, so the heads are first trained on the
model's own greedy continuations of the bench's prompts (exo_tp.finetune.mtp_heads: the target
frozen, the heads' first and second steps, mlx's Adam; the time and losses are reported).
The 1-stream prompt is one of those it trained on: its acceptance is that of a head that
knows the text, an upper bound for a trained head, not what a shipped head would keep on
unseen text (llama.cpp reports ~75% of 3 drafts kept on Qwen 3.6).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from _common import ROOT, env, launch_report, resolve, write_model

sys.path.insert(0, str(ROOT))

# Qwen 3.5's layout at a size a CPU decodes quickly: 3 Gated DeltaNet layers to 1 gated
# attention, tied embeddings, one MTP layer.
QWEN35: dict[str, Any] = {
    "model_type": "qwen3_5",
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "qwen3_5_text",
        "vocab_size": 49152,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 8,
        "full_attention_interval": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [8, 0, 0],
        },
        "mtp_num_hidden_layers": 1,
    },
}
PROMPTS = (
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "List ten facts about the ocean.",
)


def mtp_model(folder: Path, steps: int) -> tuple[Path, dict[str, float]]:
    """The random model with trained MTP heads, and how they were trained (in a process of
    its own: with the BLAS exo-tp's ranks multiply with, which the training's large vocabulary
    products need on a CPU; MLX's own CPU matmul took 2 s for one here)."""
    write_model(folder, resolve("smollm2-135m"), zero_eos=False, **QWEN35)
    command = [sys.executable, str(Path(__file__)), "train", str(folder), str(steps)]
    done = subprocess.run(command, env=env(), capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"training the MTP heads failed:\n{done.stderr[-3000:]}")
    return folder, json.loads(done.stdout.strip().splitlines()[-1])


def _train(folder: Path, steps: int) -> None:
    from mlx_lm import load

    from exo_tp.finetune.mtp_heads import add_random_heads, train_heads

    add_random_heads(folder, seed=1)
    tokenizer = load(str(folder))[1]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        for p in PROMPTS
    ]
    config = json.loads((folder / "config.json").read_text())
    trained = train_heads(folder, config, prompts, tokens=96, steps=steps)
    report = {
        "train_seconds": round(trained.seconds, 1),
        "train_steps": steps,
        "loss_before": round(trained.loss_before, 3),
        "loss_after": round(trained.loss_after, 3),
    }
    print(json.dumps(report))


def _launch(model: Path, args: argparse.Namespace, report: Path, *extra: str) -> Any:
    command = [sys.executable, "-m", "exo_tp", "launch", "--ranks", "2"]
    command += ["--weights", args.weights, "--model", str(model), "--prompt", PROMPTS[0]]
    command += ["--max-tokens", str(args.tokens), "--report-out", str(report), *extra]
    done = subprocess.run(command, env=env(), capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"exo-tp launch failed:\n{done.stderr[-3000:]}")
    return launch_report(report)


def _under_load(model: Path, args: argparse.Namespace, logs: Path, flag: str) -> float:
    from serving import aggregate_under_load

    extra = ("--weights", args.weights, flag)
    return aggregate_under_load(
        f"mtp{flag}", str(model), logs, extra, args.streams, args.load_tokens
    )


def run_mtp(args: argparse.Namespace, tmp: Path) -> None:
    model, training = mtp_model(tmp / "qwen35-mtp", args.train_steps)
    print(f"heads trained: {training}", file=sys.stderr)
    tps: dict[str, list[float]] = {"plain": [], "mtp": []}
    kept: list[float] = []
    same = True
    for round_ in range(args.rounds):  # alternating: drift hits both alike
        plain = _launch(model, args, tmp / "plain.json", "--no-mtp", "--num-draft-tokens", "0")
        mtp = _launch(
            model, args, tmp / "mtp.json", "--mtp", "--num-draft-tokens", str(args.mtp_drafts)
        )
        tps["plain"].append(plain.generation_tps)
        tps["mtp"].append(mtp.generation_tps)
        kept.append(mtp.accepted_tokens / mtp.drafted_tokens if mtp.drafted_tokens else 0.0)
        same = same and plain.tokens == mtp.tokens
        print(
            f"round {round_ + 1}: plain {plain.generation_tps:.2f} tok/s, mtp "
            f"{mtp.generation_tps:.2f} tok/s ({mtp.accepted_tokens}/{mtp.drafted_tokens} kept)",
            file=sys.stderr,
        )
    loads: dict[str, list[float]] = {"plain": [], "mtp": []}
    for _ in range(args.rounds):
        loads["plain"].append(_under_load(model, args, tmp, "--no-mtp"))
        loads["mtp"].append(_under_load(model, args, tmp, "--mtp"))
    one = {k: statistics.median(v) for k, v in tps.items()}
    many = {k: statistics.median(v) for k, v in loads.items()}
    ratio = one["mtp"] / one["plain"] if one["plain"] else 0.0
    load_ratio = many["mtp"] / many["plain"] if many["plain"] else 0.0
    print(
        f"Qwen 3.5-shaped random model, trained MTP heads, 2 ranks {args.weights}, "
        f"{args.tokens} tokens, {args.mtp_drafts} drafts a step, median of {args.rounds} rounds"
    )
    print(f"1 stream: plain {one['plain']:.2f} tok/s, mtp {one['mtp']:.2f} tok/s ({ratio:.2f}x)")
    print(f"acceptance {statistics.median(kept):.2f}; same tokens: {same}")
    print(f"{args.streams} streams: mtp / plain {load_ratio:.2f}x aggregate")
    result = {
        "plain_tps": round(one["plain"], 3),
        "mtp_tps": round(one["mtp"], 3),
        "mtp_over_plain": round(ratio, 3),
        "mtp_acceptance": round(statistics.median(kept), 3),
        "same_tokens": same,
        "under_load_streams": args.streams,
        "under_load_mtp_over_plain": round(load_ratio, 3),
        **training,
    }
    print(json.dumps(result))


if __name__ == "__main__":  # the training worker (mtp_model)
    _train(Path(sys.argv[2]), int(sys.argv[3]))
