"""Decode speed of exo-tp on 2 local ranks vs single-process mlx-lm, measured in one run.

Also times the padded all-gather (uneven vocab shards padded to the largest) against an
equal-shape all-gather of the same payload. Rounds alternate between the contenders so drift
on this noisy machine hits all of them alike; medians are reported.

    python bench/tp_decode.py [--model smollm2-135m] [--tokens 128] [--rounds 3] [--quick]

``--quick``: 1 round, 4 tokens, 10 gathers, on a tiny random model with SmolLM2's tokenizer
(bench/_common.py's ``tiny_model``) unless --model is given.

The last line of stdout is one JSON object with the headline ratios.
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
    WorkerResult,
    env,
    exo_tp_tps,
    model_folder,
    model_name,
    single_process_tps,
    worker_result,
)


class GatherTimes(WorkerResult):
    """Rank 0's best median of each all-gather (seconds)."""

    padded: float  # uneven shards padded to the largest
    equal: float  # equal shards of the same payload


GATHER = """
import json, sys, time, mlx.core as mx
from tp_decode import GatherTimes
from exo_tp.transport.ring import init_ring, barrier
from exo_tp.shard.collectives import gather_padded
group = init_ring(); r = group.rank()
sizes = json.loads(sys.argv[1]); iters = int(sys.argv[2])
equal = sum(sizes) // len(sizes)
uneven = mx.ones((1, sizes[r])); even = mx.ones((1, equal)); mx.eval(uneven, even)
def timed(fn):
    out = []
    for _ in range(iters):
        mx.eval(mx.distributed.all_sum(mx.ones(1), group=group))  # line up the ranks
        t = time.perf_counter(); mx.eval(fn()); out.append(time.perf_counter() - t)
    return sorted(out)[len(out) // 2]
res = {}
for _ in range(2):  # alternate to share drift
    res.setdefault("padded", []).append(timed(lambda: gather_padded(uneven, sizes, group)))
    res.setdefault("equal", []).append(
        timed(lambda: mx.distributed.all_gather(even, group=group)))
barrier(group)
if r == 0:
    print(GatherTimes(**{k: min(v) for k, v in res.items()}).model_dump_json())
"""


def gather_times(sizes: list[int], iters: int) -> GatherTimes:
    from exo_tp.transport.ports import free_ports
    from exo_tp.transport.ring import ring_env, write_hostfile

    with tempfile.TemporaryDirectory() as tmp:
        hostfile = Path(tmp) / "hosts.json"
        write_hostfile(hostfile, [f"127.0.0.1:{p}" for p in free_ports(len(sizes))])
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", GATHER, json.dumps(sizes), str(iters)],
                env={**env(), **ring_env(r, hostfile, env())},
                stdout=subprocess.PIPE,
                text=True,
            )
            for r in range(len(sizes))
        ]
        outs = [p.communicate(timeout=300)[0] for p in procs]
    return worker_result(outs[0], GatherTimes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help=MODEL_HELP)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--uneven", default="0.7,0.3")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 1 round, 4 tokens, 10 gathers"
    )
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.tokens = 1, 4
    model = model_folder(args.model, args.quick)
    from exo_tp.plan import load_spec, plan_tensor_parallel

    uneven = [float(w) for w in args.uneven.split(",")]
    runs: dict[str, list[float]] = {"single": [], "tp2_even": [], "tp2_uneven": []}
    for round_ in range(args.rounds):
        runs["single"].append(single_process_tps(model, args.tokens))
        runs["tp2_even"].append(exo_tp_tps(model, [1, 1], args.tokens))
        runs["tp2_uneven"].append(exo_tp_tps(model, uneven, args.tokens))
        print(
            f"round {round_ + 1}: " + ", ".join(f"{k} {v[-1]:.2f} tok/s" for k, v in runs.items()),
            file=sys.stderr,
        )
    tps = {k: statistics.median(v) for k, v in runs.items()}

    plan = plan_tensor_parallel(load_spec(model), uneven)
    vocab_sizes = list(plan.collective("logits").sizes)
    gather = gather_times(vocab_sizes, iters=10 if args.quick else 200)

    print(
        f"model {model_name(args.model, args.quick)}, {args.tokens} tokens, fp32, "
        f"median of {args.rounds} rounds"
    )
    print(f"{'contender':<28}{'tok/s':>8}{'vs single':>11}")
    for name, label in (
        ("single", "mlx-lm, 1 process"),
        ("tp2_even", "exo-tp 2 ranks 1:1"),
        ("tp2_uneven", f"exo-tp 2 ranks {args.uneven}"),
    ):
        print(f"{label:<28}{tps[name]:>8.2f}{tps[name] / tps['single']:>10.2f}x")
    print(
        f"logits all-gather {vocab_sizes} padded to {max(vocab_sizes)}: "
        f"{gather.padded * 1e3:.3f} ms vs equal shapes {gather.equal * 1e3:.3f} ms"
    )
    print(
        json.dumps(
            {
                "single_tps": round(tps["single"], 3),
                "tp2_even_tps": round(tps["tp2_even"], 3),
                "tp2_uneven_tps": round(tps["tp2_uneven"], 3),
                "tp2_even_over_single": round(tps["tp2_even"] / tps["single"], 3),
                "tp2_uneven_over_single": round(tps["tp2_uneven"] / tps["single"], 3),
                "gather_padded_ms": round(gather.padded * 1e3, 4),
                "gather_equal_ms": round(gather.equal * 1e3, 4),
                "gather_padded_over_equal": round(gather.padded / gather.equal, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
