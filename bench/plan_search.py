"""How long the planner takes to choose a plan for a 671B-class MoE over 64 devices.

The spec is DeepSeek-V3-shaped (61 layers, hidden 7168, 128 heads, 256 experts of 2048 rows,
8 per token, 3 dense layers, untied vocab 129280) in 4-bit group 64: about 700B parameters,
~390 GB. The 64 devices come in four kinds (800/400/200/100 GB/s at 192/64/32/16 GB), eight to
a Thunderbolt island (30 µs, 8 GB/s), the islands joined by 10 GbE (300 µs, 1.1 GB/s).

    python bench/plan_search.py [--devices 64] [--rounds 5] [--quick]

``--quick``: 16 devices (two islands, so both link kinds are priced), one round.

The last line of stdout is one JSON object; "seconds" is the median wall time of a search.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exo_tp.plan import ModelSpec, Quantization  # noqa: E402
from exo_tp.plan.cluster import Cluster, DeviceCost, Link  # noqa: E402
from exo_tp.plan.cost import LinkCost  # noqa: E402
from exo_tp.plan.search import choose_plan  # noqa: E402

SPEC = ModelSpec(
    model_type="deepseek_v3",
    hidden_size=7168,
    num_layers=61,
    num_heads=128,
    num_kv_heads=128,
    head_dim=192,  # MLA: a query head is nope (128) + rope (64) wide
    head_widths={"kv_b_head_dim": 256, "v_head_dim": 128},  # kv_b: nope + v; v: 128
    ffn_sizes={"ffn": 18432, "expert_ffn": 2048, "shared_expert_ffn": 2048},
    vocab_size=129280,
    tie_word_embeddings=False,
    quantization=Quantization(group_size=64, bits=4),
    num_experts=256,
    experts_per_token=8,
    dense_layers=3,
    context_length=4096,
)
KINDS = [(800, 192), (400, 64), (200, 32), (100, 16)]  # GB/s, GB
THUNDERBOLT = LinkCost(latency=30e-6, bandwidth=8e9, measured=True)
ETHERNET = LinkCost(latency=300e-6, bandwidth=1.1e9, measured=True)


def cluster(count: int) -> Cluster:
    devices = tuple(
        DeviceCost(
            name=f"d{i}",
            seconds_per_byte=1 / (KINDS[i % 4][0] * 1e9),
            prefill_flops=20e12,
            memory=int(KINDS[i % 4][1] * 1e9 * 0.9),
        )
        for i in range(count)
    )
    links = tuple(
        Link(a=a, b=b, cost=THUNDERBOLT)
        for a in range(count)
        for b in range(a + 1, count)
        if a // 8 == b // 8
    )
    return Cluster(devices=devices, links=links, default_link=ETHERNET)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 16 devices, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.devices, args.rounds = 16, 1
    devices = cluster(args.devices)
    times = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        choice = choose_plan(SPEC, devices)
        times.append(time.perf_counter() - start)
    best = choice.best
    print(
        f"{args.devices} devices, {SPEC.model_type}-shaped spec: {choice.considered} plans "
        f"considered, {len(choice.rejected)} do not fit"
    )
    print(
        f"chosen: {best.kind}, {len(best.groups)} stages over {len(best.devices)} devices, "
        f"predicted {best.prediction.tokens_per_second:.3g} tokens/s"
    )
    print(
        f"search time: min {min(times):.3f} s, median {statistics.median(times):.3f} s, "
        f"max {max(times):.3f} s over {args.rounds} rounds"
    )
    print(
        json.dumps(
            {
                "devices": args.devices,
                "seconds": round(statistics.median(times), 4),
                "max_seconds": round(max(times), 4),
                "considered": choice.considered,
                "under_one_second": max(times) < 1.0,
                "chosen": best.kind,
                "chosen_tokens_per_second": round(best.prediction.tokens_per_second, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
