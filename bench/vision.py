"""Images on 3 uneven local ranks (shares 5, 3, 1) against single-device mlx-vlm, in one run:

- time to first token of a one-image prompt: the cluster (the tower on rank 0, the merged input
  entering the embedding's all-reduce) over mlx-vlm's `stream_generate` on one device, the
  same prompt and image, medians over rounds taken in turn;
- aggregate tokens/s of 4 concurrent image streams over 4 concurrent text streams on the same
  ranks (each image prompt another image, so every one runs the tower and misses the cache).

Both sides use the library: `exo_tp.load(...).stream_generate(prompt, image=[...])` and mlx-vlm's
`load`/`stream_generate`; the greedy tokens of the first image must agree (checked, reported).

    python bench/vision.py [--model FOLDER] [--family qwen3_5|gemma4] [--tokens 32]
        [--rounds 3] [--size 224] [--quick]

Without --model, a random checkpoint of --family is written from mlx-vlm's own classes
(tests/vlm_models.py; its tiny shapes: the figures measure the path's overheads, not a real
model's compute; give --model a real mlx-vlm folder for those). ``--quick``: 1 round, 8 tokens.

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _common import ROOT

sys.path.insert(0, str(ROOT / "tests"))  # the random vision checkpoints and reference helpers
WEIGHTS = [5.0, 3.0, 1.0]
STREAMS = 4


def _image(shade: int, size: int) -> Any:
    from vlm_models import gradient

    return gradient(shade, size, size)


def _checkpoint(args: argparse.Namespace, scratch: Path) -> Path:
    if args.model:
        return Path(args.model)
    from vlm_models import write_tiny_vlm

    from exo_tp.models.registry import resolve_model

    return write_tiny_vlm(scratch / args.family, args.family, resolve_model("smollm2-135m"))


def _first_token(chunks: Any) -> tuple[float, list[int]]:
    """(seconds to the first token, the tokens) of a stream of responses."""
    started, first, tokens = time.perf_counter(), None, []
    for response in chunks:
        if response.token is None:
            continue
        first = first if first is not None else time.perf_counter() - started
        tokens.append(response.token)
    return first or 0.0, tokens


def _aggregate(model: Any, prompts: list[tuple[str, list[Any]]], tokens: int) -> float:
    """Tokens/s of the prompts streamed at once (each with its images, if any)."""

    def one(prompt: str, images: list[Any]) -> int:
        out = model.stream_generate(prompt, tokens, image=images or None)
        return sum(1 for r in out if r.token is not None)

    started = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        made = sum(pool.map(lambda p: one(*p), prompts))
    return made / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="an mlx-vlm checkpoint folder (default: a random one)")
    parser.add_argument("--family", default="qwen3_5", choices=("qwen3_5", "gemma4"))
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=224, help="image side in pixels")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.tokens = 1, 8
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from mlx_vlm import load, stream_generate
    from mlx_vlm.prompt_utils import apply_chat_template

    import exo_tp

    with tempfile.TemporaryDirectory(prefix="bench-vision-") as scratch:
        folder = _checkpoint(args, Path(scratch))
        reference, processor = load(str(folder))
        prompt = apply_chat_template(
            processor, reference.config, "Describe the image.", num_images=1
        )
        text_prompt = apply_chat_template(
            processor, reference.config, "Tell me a story.", num_images=0
        )
        image = _image(1, args.size)
        ttft: dict[str, list[float]] = {"cluster": [], "mlx_vlm": []}
        with exo_tp.load(str(folder), ranks=len(WEIGHTS), weights=WEIGHTS) as model:
            same = True
            for round_ in range(args.rounds):
                shade = 10 + round_  # a new image each round: the tower runs, the cache misses
                picture = _image(shade, args.size)
                seconds, ours = _first_token(
                    model.stream_generate(prompt, args.tokens, image=[picture])
                )
                ttft["cluster"].append(seconds)
                one = stream_generate(
                    reference,
                    processor,
                    prompt,
                    image=[picture],
                    max_tokens=args.tokens,
                    temperature=0.0,
                )
                seconds, theirs = _first_token(one)
                ttft["mlx_vlm"].append(seconds)
                # (mlx-vlm's last response repeats its last token)
                same = same and ours == theirs[: len(ours)]
            images = [(prompt, [_image(20 + i, args.size)]) for i in range(STREAMS)]
            texts = [(text_prompt + " " * i, []) for i in range(STREAMS)]
            image_rate = _aggregate(model, images, args.tokens)
            text_rate = _aggregate(model, texts, args.tokens)
        del image
    cluster, single = statistics.median(ttft["cluster"]), statistics.median(ttft["mlx_vlm"])
    result = {
        "model": str(args.model or f"random {args.family}"),
        "weights": WEIGHTS,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "ttft_cluster_s": round(cluster, 4),
        "ttft_mlx_vlm_s": round(single, 4),
        "ttft_ratio": round(cluster / single, 3) if single else None,
        "image_streams_tokens_per_s": round(image_rate, 2),
        "text_streams_tokens_per_s": round(text_rate, 2),
        "image_over_text_throughput": round(image_rate / text_rate, 3) if text_rate else None,
        "same_tokens_as_mlx_vlm": same,
    }
    print(
        f"time to first token, 1 image: cluster {cluster:.3f} s, mlx-vlm {single:.3f} s "
        f"({result['ttft_ratio']}x); {STREAMS} image streams {image_rate:.1f} tok/s, "
        f"{STREAMS} text streams {text_rate:.1f} tok/s; tokens equal: {same}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
