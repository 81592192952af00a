"""What a tensor-parallel collective costs when one rank trails the other.

Two ranks (MLX `ring` over loopback, one core each, OpenBLAS on one thread) run the decode of a
stack of SmolLM2-sized half layers (hidden 576, FFN 768: one rank's share of an even 2-way
split) with an all_sum after each attention and each FFN, as exo-tp's shards do. Rank i does
``f_i`` times the matmul work of each segment (extra products folded in as exact zeros, as the
lab's work factor does), for the pairs in --pairs. Per pair, alternating rounds measure each
rank's step without the all_sums and the pair's step with them; a collective's cost is the
step with them minus the slower rank's step without, per all_sum. Each pair's cost is printed
beside its ratio to the balanced pair's (1, 1).

The question it answers: does a collective cost less when one rank clearly trails (the other is
already waiting), so that a cost model should discount it for unbalanced splits? On the 2-core
VM, three runs said yes, somewhat and no (docs/benchmarks.md, "Heterogeneous lab").

    python bench/sync_probe.py [--pairs 1,1:1,2:2,2:1,3:3,3] [--rounds 6] [--layers 12] [--quick]

``--quick``: a smoke run (pairs 1,1 and 1,2, one round, 2 layers); it measures nothing worth
reporting.

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import ROOT, WorkerResult, env, pinned, worker_result

sys.path.insert(0, str(ROOT))

from exo_tp.frozen import Frozen  # noqa: E402

RANK = """
import json, sys
import mlx.core as mx
from sync_probe import Round, Rounds
from mlx_lm.models.cache import KVCache
from mlx_lm.models.llama import ModelArgs, TransformerBlock
from exo_tp.profile.collective_speed import median_seconds

group = mx.distributed.init(backend="ring", strict=True)
rank, layers, rounds = group.rank(), int(sys.argv[1]), int(sys.argv[2])
pairs = json.loads(sys.argv[3])
args = ModelArgs(model_type="llama", hidden_size=576, num_hidden_layers=layers,
                 intermediate_size=768, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, rms_norm_eps=1e-5, vocab_size=256)
copies = max(max(p) for p in pairs)
stacks = [[TransformerBlock(args) for _ in range(layers)] for _ in range(copies)]
caches = [KVCache() for _ in range(layers)]
mx.eval([[b.parameters() for b in s] for s in stacks])
h = mx.random.normal((1, 64, 576))
for block, cache in zip(stacks[0], caches):
    h = block(h, mask="causal", cache=cache)
x = mx.random.normal((1, 1, 576)) * 0.1
mx.eval(h, x)

def step(reduce, factor):
    y = x
    for i, cache in enumerate(caches):
        block = stacks[0][i]
        n = block.input_layernorm(y)
        a = block.self_attn(n, cache=cache)
        for extra in stacks[1:factor]:  # the same projections' reads again, an exact zero
            a = a + 0 * extra[i].self_attn.o_proj(extra[i].self_attn.q_proj(n))[..., :1]
        y = y + (mx.distributed.all_sum(a, group=group) if reduce else a)
        n = block.post_attention_layernorm(y)
        m = block.mlp(n)
        for extra in stacks[1:factor]:
            m = m + 0 * extra[i].mlp(n)[..., :1]
        y = y + (mx.distributed.all_sum(m, group=group) if reduce else m)
        cache.offset -= 1  # decode "the next token" again: the context stays the same
    mx.eval(y)

done = []
for r in range(rounds):
    for pair in pairs if r % 2 == 0 else pairs[::-1]:
        alone = median_seconds(lambda: step(False, pair[rank]), 11)
        together = median_seconds(lambda: step(True, pair[rank]), 11)
        both = mx.distributed.all_gather(mx.array([alone]), group=group).tolist()
        done.append(Round(pair=pair, alone=both, together=together))
if rank == 0:
    print(Rounds(rounds=done).model_dump_json())
"""


class Round(WorkerResult):
    """One round of one pair, as rank 0 saw it: each rank's step without the all_sums and the
    pair's step with them (seconds)."""

    pair: tuple[int, int]
    alone: tuple[float, float]
    together: float

    def collective_seconds(self, per_step: int) -> float:
        """What one all_sum cost: the step with them minus the slower rank's without."""
        return (self.together - max(self.alone)) / per_step


class Rounds(WorkerResult):
    """What rank 0 prints: every round of every pair."""

    rounds: tuple[Round, ...]


def run_ranks(layers: int, rounds: int, pairs: list[list[int]]) -> Rounds:
    environment = env()  # also puts this checkout on sys.path
    from exo_tp.process.blas import THREADS_ENV
    from exo_tp.transport.ports import free_ports

    cores = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        hosts = Path(tmp) / "hosts.json"
        hosts.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
        base = {**environment, "MLX_HOSTFILE": str(hosts), THREADS_ENV: "1"}
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", RANK, str(layers), str(rounds), json.dumps(pairs)],
                env={**base, "MLX_RANK": str(rank)},
                stdout=subprocess.PIPE,
                text=True,
                preexec_fn=pinned(cores[rank % len(cores)]),
            )
            for rank in range(2)
        ]
        outs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("a rank failed")
    return worker_result(outs[0], Rounds)


class PairCost(Frozen):
    """One pair's medians over its rounds."""

    rank_ms: tuple[float, float]  # each rank's step without the all_sums
    gap_us: float  # how far apart the ranks' steps were, per all_sum
    collective_us: float  # one all_sum's cost
    collective_us_each_round: tuple[int, ...]
    over_balanced: float  # collective_us against the balanced pair's (1, 1)


class Result(Frozen):
    """The last line of stdout."""

    layers: int
    rounds: int
    pairs: dict[str, PairCost]  # keyed "[f0, f1]", as earlier runs printed them


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", default="1,1:1,2:2,2:1,3:3,3")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="a smoke run (tiny settings)")
    args = parser.parse_args()
    if args.quick:
        args.pairs, args.rounds, args.layers = "1,1:1,2", 1, 2
    pairs = [[int(f) for f in p.split(",")] for p in args.pairs.split(":")]
    if [1, 1] not in pairs:
        pairs.insert(0, [1, 1])  # what every pair is compared with
    measured = run_ranks(args.layers, args.rounds, pairs)
    per_step = 2 * args.layers  # all_sums per step
    by_pair: dict[tuple[int, int], list[Round]] = {}
    for one in measured.rounds:
        by_pair.setdefault(one.pair, []).append(one)

    def cost(got: list[Round]) -> float:
        return statistics.median(r.collective_seconds(per_step) for r in got)

    balanced = cost(by_pair[1, 1])
    rows = {}
    print(f"{'pair':>8} {'ms r0':>7} {'ms r1':>7} {'gap us':>7} {'cost us':>8} {'/ (1,1)':>8}")
    for pair, got in by_pair.items():
        key, collective = str(list(pair)), cost(got)
        row = PairCost(
            rank_ms=tuple(
                round(statistics.median(r.alone[i] for r in got) * 1e3, 2) for i in (0, 1)
            ),
            gap_us=round(
                statistics.median(abs(r.alone[1] - r.alone[0]) for r in got) / per_step * 1e6, 1
            ),
            collective_us=round(collective * 1e6, 1),
            collective_us_each_round=tuple(
                round(r.collective_seconds(per_step) * 1e6) for r in got
            ),
            over_balanced=round(collective / balanced, 3),
        )
        rows[key] = row
        print(
            f"{key:>8} {row.rank_ms[0]:7.1f} {row.rank_ms[1]:7.1f} {row.gap_us:7.0f} "
            f"{row.collective_us:8.0f} {row.over_balanced:8.2f}"
        )
    print(Result(layers=args.layers, rounds=args.rounds, pairs=rows).model_dump_json())


if __name__ == "__main__":
    main()
