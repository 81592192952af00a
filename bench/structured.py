"""What constrained decoding costs per decode step: 16 streams of SmolLM2 (float32, one
process, mlx-lm's BatchGenerator as every rank runs it) decoding with no grammar, then each
stream under its own JSON grammar (`exo_tp.grammar.mask.GrammarMask`, as the conductor adds
it), in alternating rounds. Printed: ms per step of each, their ratio (the target: at most
1.05), and the time spent inside the masks per step.

The grammar is JSON lines of objects with a bounded string, an integer and an enum, which
never ends (end-of-sequence is banned in both runs alike), so the batch stays at 16 streams
for every timed step.

    python bench/structured.py [--streams 16] [--steps 32] [--rounds 3] [--quick]

``--quick``: a smoke run (4 streams, 3 steps, 1 round); it measures nothing worth reporting.

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from _common import PROMPT, ROOT

sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import BatchGenerator  # noqa: E402

from exo_tp.grammar.compiler import grammars_for  # noqa: E402
from exo_tp.grammar.mask import GrammarMask  # noqa: E402
from exo_tp.models.registry import prepare_default_models  # noqa: E402
from exo_tp.wire.runtime import Constraint  # noqa: E402

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
}
LINES = Constraint(kind="lark", grammar=f'start: line+\nline: %json {json.dumps(RECORD)} "\\n"\n')


class Timed:
    """A processor's time, summed (what the masks cost inside a step)."""

    def __init__(self, processor: Any, spent: list[float]):
        self.processor, self.spent = processor, spent

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        start = time.perf_counter()
        out = self.processor(tokens, logits)
        self.spent.append(time.perf_counter() - start)
        return out


def run(model: Any, tokenizer: Any, streams: int, steps: int, masked: bool) -> tuple[float, float]:
    """(seconds per decode step, seconds inside the masks per step) over ``steps`` steps."""
    vocab = model.args.vocab_size
    eos = sorted(tokenizer.eos_token_ids)

    def no_eos(tokens: mx.array, logits: mx.array) -> mx.array:
        return logits.at[:, eos].add(-mx.inf)  # the batch keeps all its streams

    spent: list[float] = []
    grammars = grammars_for(tokenizer, vocab)
    processors = [
        [no_eos, Timed(GrammarMask(grammars.matcher(LINES), vocab, eos), spent)]
        if masked
        else [no_eos]
        for _ in range(streams)
    ]
    prompt = tokenizer.encode(PROMPT)
    generator = BatchGenerator(
        model, stop_tokens=None, completion_batch_size=streams, prefill_batch_size=streams
    )
    generator.insert(
        [prompt] * streams, max_tokens=[steps + 8] * streams, logits_processors=processors
    )
    while len(generator._generation_batch) < streams:  # prefill, and the first token
        generator.next()
    generator.next()
    spent.clear()
    start = time.perf_counter()
    for _ in range(steps):
        generator.next()
    seconds = (time.perf_counter() - start) / steps
    generator.close()
    return seconds, sum(spent) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smoke run (tiny settings)")
    args = parser.parse_args()
    if args.quick:
        args.streams, args.steps, args.rounds = 4, 3, 1
    model, tokenizer = load(str(prepare_default_models()["smollm2-135m"]))
    model.set_dtype(mx.float32)
    plain, masked, inside = [], [], []
    for _ in range(args.rounds):  # alternating: both see the same load on a shared box
        plain.append(run(model, tokenizer, args.streams, args.steps, masked=False)[0])
        step, mask = run(model, tokenizer, args.streams, args.steps, masked=True)
        masked.append(step)
        inside.append(mask)
    plain_ms, masked_ms = statistics.median(plain) * 1e3, statistics.median(masked) * 1e3
    inside_ms = statistics.median(inside) * 1e3
    ratio = masked_ms / plain_ms
    print(f"{args.streams} streams, {args.steps} steps x {args.rounds} rounds (medians)")
    print(f"  no grammar     {plain_ms:8.2f} ms/step")
    print(f"  JSON grammars  {masked_ms:8.2f} ms/step  ({inside_ms:.2f} ms inside the masks)")
    print(f"  ratio          {ratio:8.3f}  (target <= 1.05)")
    print(
        json.dumps(
            {
                "streams": args.streams,
                "steps": args.steps,
                "rounds": args.rounds,
                "plain_ms_per_step": round(plain_ms, 3),
                "masked_ms_per_step": round(masked_ms, 3),
                "mask_ms_per_step": round(inside_ms, 3),
                "ratio": round(ratio, 4),
            }
        )
    )


if __name__ == "__main__":
    main()
