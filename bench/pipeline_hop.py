"""Per-token cost of a pipeline hop, measured two ways in one run.

1. Raw hop: a decode-sized hidden state (1 x 1 x hidden, float32) sent stage to stage and back
   over a hop link (an authenticated channel: typed header + raw bytes) between two
   threads: one-way latency.
2. End to end: decode tokens/s of plain mlx-lm vs a 2-stage pipeline of one rank each
   (`exo-tp launch --stages 1,1`). Both do the same arithmetic on one core at a time, so the
   difference per token is what the pipeline adds: two hops (the tokens to stage 0, the hidden
   state to stage 1) plus one evaluation barrier per stage.

    python bench/pipeline_hop.py [--model smollm2-135m] [--tokens 96] [--rounds 3] [--quick]

``--quick``: 1 round, 4 tokens, 20 hops, on a tiny random model with SmolLM2's tokenizer
(bench/_common.py's ``tiny_model``) unless --model is given.

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

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


class HopTime(WorkerResult):
    one_way: float  # seconds, the median round trip's half


PING = """
import sys, time, threading, mlx.core as mx
from pipeline_hop import HopTime
from exo_tp.transport.channel import accept_count, connect
from exo_tp.wire.runtime import HOP_MESSAGES
from exo_tp.runtime.pipeline import recv_hidden, send_hidden
from exo_tp.transport.ports import free_ports
hidden, iters = int(sys.argv[1]), int(sys.argv[2])
address, key = f"127.0.0.1:{free_ports(1)[0]}", b"bench"
result = []
def side(first):
    if first:
        link = accept_count(address, key, HOP_MESSAGES, 1, 30, "bench")[0]
    else:
        link = connect(address, key, HOP_MESSAGES, 30)
    x = mx.ones((1, 1, hidden)); mx.eval(x)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        if first:
            send_hidden(link, x); recv_hidden(link)
        else:
            recv_hidden(link); send_hidden(link, x)
        times.append(time.perf_counter() - t)
    if first:
        result.append(HopTime(one_way=sorted(times)[len(times) // 2] / 2))
t = threading.Thread(target=side, args=(False,)); t.start()
side(True); t.join()
print(result[0].model_dump_json())
"""


def raw_hop_seconds(hidden: int, iters: int) -> float:
    out = subprocess.run(
        [sys.executable, "-c", PING, str(hidden), str(iters)],
        capture_output=True,
        text=True,
        check=True,
        env=env(),
    )
    return worker_result(out.stdout, HopTime).one_way


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help=MODEL_HELP)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 1 round, 4 tokens, 20 hops"
    )
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.tokens = 1, 4
    model = model_folder(args.model, args.quick)
    from exo_tp.plan import load_spec

    hidden = load_spec(model).hidden_size
    runs: dict[str, list[float]] = {"single": [], "pipeline_1_1": []}
    for round_ in range(args.rounds):
        runs["single"].append(single_process_tps(model, args.tokens))
        runs["pipeline_1_1"].append(exo_tp_tps(model, [1, 1], args.tokens, "--stages", "1,1"))
        print(
            f"round {round_ + 1}: " + ", ".join(f"{k} {v[-1]:.2f} tok/s" for k, v in runs.items()),
            file=sys.stderr,
        )
    tps = {k: statistics.median(v) for k, v in runs.items()}
    added = 1 / tps["pipeline_1_1"] - 1 / tps["single"]
    hop = raw_hop_seconds(hidden, 20 if args.quick else 200)
    print(
        f"model {model_name(args.model, args.quick)}, {args.tokens} tokens, fp32, "
        f"median of {args.rounds} rounds"
    )
    print(f"raw hop (1x1x{hidden} float32, one way): {hop * 1e3:.3f} ms")
    print(
        f"mlx-lm one process: {tps['single']:.2f} tok/s; 2-stage pipeline (1+1): "
        f"{tps['pipeline_1_1']:.2f} tok/s; added per token: {added * 1e3:.2f} ms"
    )
    print(
        json.dumps(
            {
                "hop_one_way_ms": round(hop * 1e3, 4),
                "single_tps": round(tps["single"], 3),
                "pipeline_1_1_tps": round(tps["pipeline_1_1"], 3),
                "pipeline_over_single": round(tps["pipeline_1_1"] / tps["single"], 3),
                "pipeline_added_ms_per_token": round(added * 1e3, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
