"""One-row float32 products whole against in row pieces (exo_tp/shard/row_pieces.py), side by
side in one run, on the BLAS `exo-tp` preloads (OpenBLAS on Linux).

1. Shapes: seconds per weight byte of ``x @ W.T`` with x one row, for SmolLM2's FFN (576 ->
   1536, 1536 -> 576) and tied head (576 -> 49152) and for bigger models' shapes, whole and in
   pieces of at most ``PIECE_BYTES``: one core, one BLAS thread, timed as `exo-tp bench` times
   its decode kernels (``measure_kernel``, at least 1 s each).
2. Decode: `exo-tp launch` tokens/s on SmolLM2 (float32) with ``EXO_TP_ROW_PIECES=0`` and
   without (pieces on), alternating, median of ``--rounds``: one rank on one core, one rank on
   every core (the BLAS's threads), and even TP on 2 ranks.

Last line: JSON with every figure and the pieced / whole ratios.

    python bench/row_pieces.py [--rounds 3] [--tokens 48] [--quick]

``--quick``: a smoke run (the first shape for at least 0.1 s; 1 round of 4 tokens, one rank on
one core and even TP, on a tiny random model with SmolLM2's tokenizer, whose 28 MB tied head is
still multiplied in pieces, unless --model is given); it measures nothing worth reporting.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import (
    MODEL_HELP,
    ROOT,
    WorkerResult,
    env,
    generation_tps,
    launch_command,
    model_folder,
    pinned,
    worker_result,
)

sys.path.insert(0, str(ROOT))
from exo_tp.process.blas import THREADS_ENV, usable_cores  # noqa: E402
from exo_tp.shard.row_pieces import PIECES_ENV  # noqa: E402

SHAPES = ((576, 1536), (1536, 576), (576, 49152), (2048, 8192), (8192, 2048), (4096, 4096))
QUICK_SHAPES = SHAPES[:1]


class ShapeTime(WorkerResult):
    """One shape's seconds per weight byte, one row, whole and in row pieces."""

    k: int
    n: int
    piece_rows: int | None  # rows per piece (None: kept whole)
    whole: float
    pieces: float


class ShapeTimes(WorkerResult):
    shapes: tuple[ShapeTime, ...]


# The device bench's own kernel timing (exo_tp.profile.kernels.measure_kernel: distinct
# matrices beyond the caches, as a decode step reads each layer once), with pieces off and on.
_SHAPES = """
import json, os, sys
from exo_tp.profile.kernels import KernelCase, WeightSource, measure_kernel
from exo_tp.shard.row_pieces import PIECES_ENV, piece_rows
import mlx.core as mx
from row_pieces import ShapeTime, ShapeTimes
shapes, least = [tuple(s) for s in json.loads(sys.argv[1])], float(sys.argv[2])
source, out = WeightSource(tuple(shapes)), []
for k, n in shapes:
    seconds = {}
    for name, setting in (("whole", "0"), ("pieces", "1")):
        os.environ[PIECES_ENV] = setting
        case = KernelCase("matvec", "float32", 1, k, n)
        seconds[name] = 1 / measure_kernel(case, source, least).weight_bytes_per_second
    out.append(ShapeTime(k=k, n=n, piece_rows=piece_rows(mx.zeros((n, k))), **seconds))
print(ShapeTimes(shapes=out).model_dump_json())
"""

# (name, ranks' weights, pinned to core 0 or not)
DECODE = (("1 rank, 1 core", [1.0], True), ("1 rank, every core", [1.0], False))
DECODE_TP = ("even TP, 2 ranks", [1.0, 1.0], False)


def shapes(
    which: tuple[tuple[int, int], ...] = SHAPES, least: float = 1.0
) -> tuple[ShapeTime, ...]:
    """Each shape timed for at least ``least`` seconds, whole and in pieces."""
    out = subprocess.run(
        [sys.executable, "-c", _SHAPES, json.dumps(which), str(least)],
        capture_output=True,
        text=True,
        check=True,
        env={**env(), THREADS_ENV: "1"},
        preexec_fn=pinned(0),
    )
    return worker_result(out.stdout, ShapeTimes).shapes


def decode_tps(
    model: Path, weights: list[float], one_core: bool, pieces: bool, tokens: int
) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run(
            launch_command(model, weights, tokens, report),
            capture_output=True,
            text=True,
            check=True,
            env={**env(), PIECES_ENV: "1" if pieces else "0"},
            preexec_fn=pinned(0) if one_core else None,
        )
        return generation_tps(report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--model", help=MODEL_HELP)
    parser.add_argument("--quick", action="store_true", help="a smoke run (tiny settings)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.tokens = 1, 4
    model = model_folder(args.model, args.quick)

    per_shape = shapes(QUICK_SHAPES, 0.1) if args.quick else shapes()
    print("seconds per weight byte (x 1e-10), one row, one core, one BLAS thread:")
    for row in per_shape:
        print(
            f"  {f'{row.k}x{row.n}':>10}: whole {row.whole * 1e10:5.2f}, in pieces of "
            f"{row.piece_rows or 'all'} rows {row.pieces * 1e10:5.2f}: "
            f"{row.whole / row.pieces:.2f}x",
            flush=True,
        )

    configs = [*DECODE, DECODE_TP] if usable_cores() >= 2 else list(DECODE)
    if args.quick:  # pinned and not, one rank and two
        configs = [c for c in configs if c is not DECODE[1]]
    runs: dict[str, dict[str, list[float]]] = {c[0]: {"whole": [], "pieces": []} for c in configs}
    for round_ in range(args.rounds):
        for name, weights, one_core in configs:
            # Alternate which goes first: the machine drifts within a round too.
            order = ("whole", "pieces") if round_ % 2 == 0 else ("pieces", "whole")
            for kind in order:
                tps = decode_tps(model, weights, one_core, kind == "pieces", args.tokens)
                runs[name][kind].append(tps)
                print(f"  round {round_ + 1} {name}, {kind}: {tps:.2f} tok/s", flush=True)
    decode = {}
    print(f"decode tokens/s, median of {args.rounds} ({args.tokens} tokens, SmolLM2 float32):")
    for name, kinds in runs.items():
        whole, pieces = statistics.median(kinds["whole"]), statistics.median(kinds["pieces"])
        decode[name] = {"whole": whole, "pieces": pieces, "pieces_over_whole": pieces / whole}
        print(f"  {name:>20}: whole {whole:6.2f}, pieces {pieces:6.2f}: {pieces / whole:.2f}x")
    print(
        json.dumps(
            {
                "shapes": {
                    f"{r.k}x{r.n}": {
                        "piece_rows": r.piece_rows,
                        "whole": r.whole,
                        "pieces": r.pieces,
                        "whole_over_pieces": r.whole / r.pieces,
                    }
                    for r in per_shape
                },
                "decode": decode,
                "rounds": args.rounds,
                "tokens": args.tokens,
            }
        )
    )


if __name__ == "__main__":
    main()
