"""What constrained decoding costs per decode step: 16 streams of SmolLM2 (float32, one
process, mlx-lm's BatchGenerator as every rank runs it) decoding with no grammar, then each
stream under its own JSON grammar (`exo_tp.grammar.mask.GrammarMask`, as the conductor adds
it). Printed: ms per step of each, their ratio (the target: at most
1.05), and the time spent inside the masks per step.

It runs in a child process with the BLAS that exo-tp's ranks preload (OpenBLAS where there
is one: `_common.env`), as a rank would. The grammar is JSON lines of objects with a bounded
string, an integer and an enum, which never ends (end-of-sequence is banned in both runs
alike), so the batch stays at 16 streams for every timed step.

    python bench/structured.py [--streams 16] [--steps 4] [--rounds 8] [--quick]

Both batches live side by side and decode in alternating blocks of --steps timed steps (after
one untimed step each: mlx-lm leaves a step in flight), --rounds blocks each.

``--quick``: a smoke run (4 streams, 2 steps, 1 round, a tiny random model with SmolLM2's
tokenizer: bench/_common.py's ``tiny_model``); it measures nothing worth reporting.

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from _common import PROMPT, ROOT, env, model_folder

sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import BatchGenerator  # noqa: E402

from exo_tp.grammar.compiler import grammars_for  # noqa: E402
from exo_tp.grammar.mask import GrammarMask  # noqa: E402
from exo_tp.wire.runtime import Constraint  # noqa: E402

CHILD = "EXO_TP_BENCH_STRUCTURED_CHILD"
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
    """A processor's own time, summed (what the masks cost inside a step): the wait for the
    previous step's token, which the mask needs first, is left out (`mx.eval` before)."""

    def __init__(self, processor: Any, spent: list[float]):
        self.processor, self.spent = processor, spent

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        mx.eval(tokens)
        start = time.perf_counter()
        out = self.processor(tokens, logits)
        self.spent.append(time.perf_counter() - start)
        return out


def prefilled(
    model: Any, tokenizer: Any, streams: int, tokens: int, spent: list[float] | None
) -> BatchGenerator:
    """``streams`` streams of one prompt, decoding; each under its own grammar when ``spent``
    is given (the masks' time goes there)."""
    vocab = model.args.vocab_size
    eos = sorted(tokenizer.eos_token_ids)

    def no_eos(tokens: mx.array, logits: mx.array) -> mx.array:
        return logits.at[:, eos].add(-mx.inf)  # the batch keeps all its streams

    grammars = grammars_for(tokenizer, vocab)
    processors = [
        [no_eos]
        if spent is None
        else [no_eos, Timed(GrammarMask(grammars.matcher(LINES), vocab, eos), spent)]
        for _ in range(streams)
    ]
    generator = BatchGenerator(
        model, stop_tokens=None, completion_batch_size=streams, prefill_batch_size=streams
    )
    prompt = tokenizer.encode(PROMPT)
    generator.insert(
        [prompt] * streams, max_tokens=[tokens] * streams, logits_processors=processors
    )
    while len(generator._generation_batch) < streams:  # prefill, and the first token
        generator.next()
    return generator


def timed_block(generator: BatchGenerator, steps: int) -> list[float]:
    """Seconds of each step of a block but its first (which finishes the other batch's work
    left in flight: mlx-lm evaluates the next step asynchronously)."""
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        generator.next()
        times.append(time.perf_counter() - start)
    return times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per block")
    parser.add_argument("--rounds", type=int, default=8, help="blocks of each, alternating")
    parser.add_argument("--quick", action="store_true", help="a smoke run (tiny settings)")
    args = parser.parse_args()
    if not os.environ.get(CHILD):  # again, with the ranks' BLAS preloaded
        child = subprocess.run([sys.executable, __file__, *sys.argv[1:]], env={**env(), CHILD: "1"})
        sys.exit(child.returncode)
    if args.quick:
        args.streams, args.steps, args.rounds = 4, 2, 1
    # --quick: a tiny random model with SmolLM2's tokenizer (the grammars are the same).
    model, tokenizer = load(str(model_folder(None, args.quick)))
    model.set_dtype(mx.float32)
    tokens = 2 * args.rounds * (args.steps + 1) + 8
    spent: list[float] = []
    plain = prefilled(model, tokenizer, args.streams, tokens, None)
    masked = prefilled(model, tokenizer, args.streams, tokens, spent)
    plain_times: list[float] = []
    masked_times: list[float] = []
    mask_steps = 0
    for round_ in range(args.rounds):  # alternating blocks, each first in turn: the same load
        order = [(plain, plain_times), (masked, masked_times)]
        for generator, times in order if round_ % 2 == 0 else order[::-1]:
            if generator is masked:
                spent_before = len(spent)
            times += timed_block(generator, args.steps)
            if generator is masked:
                del spent[spent_before : spent_before + args.streams]  # the untimed first step
                mask_steps += args.steps
    plain.close()
    masked.close()
    plain_ms = statistics.median(plain_times) * 1e3
    masked_ms = statistics.median(masked_times) * 1e3
    inside_ms = sum(spent) / mask_steps * 1e3
    ratio = masked_ms / plain_ms
    print(f"{args.streams} streams, {args.rounds} blocks of {args.steps} steps each (medians)")
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
