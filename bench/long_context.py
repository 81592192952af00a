"""Long contexts (issue #43), measured side by side in one run.

1. KV cache bytes per 1k tokens of context per rank, float32 against 8 and 4 bits: the plan's
   count (exo_tp.plan.kv_width) for SmolLM2 on 2 uneven ranks (0.6/0.4), and the bytes mlx-lm's
   own KVCache / QuantizedKVCache hold for each rank's KV heads after 1,024 tokens.
2. First-token time of a long prompt (16k tokens) on 2 uneven ranks (`exo-tp launch`) against
   single-device mlx-lm, on a random model of SmolLM2's width with fewer layers (--layers;
   SmolLM2's own context is 8k, and its 30 layers would take minutes per 16k prefill here).
3. Decoding streams during a long prefill, on the same model and 2 uneven ranks in one ring job
   (the runtime's LockstepBatch, as every rank runs it, OpenBLAS's threads shared out as
   `exo-tp` does): 4 streams decode alone (inter-token p50), then an 8k prompt joins them,
   prefilled in 512-token chunks (before issue #43) and with the step token budget
   (exo_tp.plan.step_budget: a chunk costing about one decode step, from the decode step and
   prefill speed measured here in place of device profiles), its chunks in a pass of their own
   (mlx-lm's two model calls a step) and in one pass with the streams' rows
   (exo_tp.shard.fused_step), and the 8k prompt alone: the streams' inter-token p50 during the
   prefill against alone (target 1.5x) and the prefill's time to its first token against
   alone (target 1.3x). Then one pass with budgets of 16 to 128 tokens: the trade between the
   two targets that the budget moves along. ``--link-delay-ms``: the ranks reach each other
   through a delaying proxy (bench/_delayed_link.py), collectives made slow. Last, the
   default since issue #60 (``chunks_priced``): chunks costing PREFILL_GAP - 1 decode steps,
   priced at their position; ``--priced-only`` runs only it against alone. Each case reports
   the gaps' p50, p90 and max and the steps of the three worst.
4. The price of a quantized KV cache's per-sequence path: 4 streams' decode step on one device
   (the runtime's LockstepBatch), 8-bit KV (one pass per sequence) against float (one batched
   pass), after 1k-token prompts.

    python bench/long_context.py [--layers 4] [--prompt 16384] [--joining 8192] [--quick]
        [--only PART] [--link-delay-ms MS] [--one-pass-budgets 16,32] [--priced-only]

``--quick`` takes every path on a 2-layer 64-wide model with short prompts. The last line of
stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import BENCH, ROOT, env, launch_report, mlx_lm_alone, resolve
from shaped_model import QUICK, build

WEIGHTS = [0.6, 0.4]
STREAMS = 4
FUSED_BUDGETS = [16, 24, 32, 48, 64, 128]  # budgets part 3 tries with one pass a step


def kv_bytes(model: Path) -> dict[str, object]:
    """Per rank, KV bytes per 1k tokens: the plan's count and mlx-lm's caches' own nbytes."""
    sys.path.insert(0, str(ROOT))
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from exo_tp.plan.kv_width import rank_kv_bytes_per_token
    from exo_tp.plan.pipeline import single_stage
    from exo_tp.plan.spec import load_spec
    from exo_tp.plan.tensor_parallel import plan_tensor_parallel

    spec = load_spec(model)
    plan = single_stage(plan_tensor_parallel(spec, WEIGHTS))
    tokens = 1024  # QuantizedKVCache grows in steps of 256: no slack at 1,024
    out: dict[str, object] = {}
    for bits in (None, 8, 4):
        planned = [rank_kv_bytes_per_token(plan, r, 4, bits) * tokens for r in range(plan.size)]
        measured = []
        for shard in plan.stages[0].tp.ranks:
            heads = len(shard.heads.kv_heads)
            total = 0
            for _ in range(spec.num_layers):
                cache = KVCache()
                kv = mx.zeros((1, heads, tokens, spec.head_dim))
                cache.update_and_fetch(kv, kv)
                if bits:
                    cache = cache.to_quantized(group_size=64, bits=bits)
                mx.eval(cache.state)
                total += cache.nbytes
            measured.append(total)
        out[f"{bits or 32}-bit"] = {"planned": planned, "mlx_lm": measured}
    floats = out["32-bit"]["mlx_lm"]  # type: ignore[index]
    for bits in (8, 4):
        entry = out[f"{bits}-bit"]
        entry["float_over_quantized"] = [  # type: ignore[index]
            round(f / q, 3)
            for f, q in zip(floats, entry["mlx_lm"], strict=True)  # type: ignore[index]
        ]
    return out


def first_token(model: Path, prompt_tokens: int) -> dict[str, float]:
    """Seconds to the first token of one ``prompt_tokens`` prompt: exo-tp on 2 uneven ranks,
    single-device mlx-lm (fresh processes, the same prompt text)."""
    text = " ".join(["river"] * (prompt_tokens - 1))
    alone = mlx_lm_alone(model, 2, text)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "exo_tp",
                "launch",
                "--ranks",
                "2",
                "--weights",
                ",".join(map(str, WEIGHTS)),
                "--model",
                str(model),
                "--prompt",
                text,
                "--ignore-chat-template",
                "--max-tokens",
                "2",
                "--report-out",
                str(report),
            ],
            capture_output=True,
            text=True,
            check=True,
            env=env(),
        )
        ours = launch_report(report)
    exo = ours.prompt_tokens / ours.prompt_tps
    single = ours.prompt_tokens / alone.prompt_tps
    return {
        "prompt_tokens": ours.prompt_tokens,
        "exo_tp_seconds": round(exo, 3),
        "mlx_lm_seconds": round(single, 3),
        "exo_tp_over_mlx_lm": round(exo / single, 3),
    }


# Every rank: its shard, the runtime's LockstepBatch, greedy; rank 0 times each step.
_RING = """
import json, sys, time
import mlx.core as mx
import numpy as np
from pathlib import Path
from mlx_lm.tokenizer_utils import load as load_tokenizer
from exo_tp.plan.spec import load_spec
from exo_tp.plan.step_budget import MIN_CHUNK, PREFILL_GAP, attention_ratio
from exo_tp.plan.tensor_parallel import plan_tensor_parallel
from exo_tp.runtime.batching import LockstepBatch
from exo_tp.shard.apply import load_shard
from exo_tp.shard.fused_step import FusedForward
from exo_tp.transport.ring import barrier, init_ring
from exo_tp.wire.assignment import ServingOptions
from exo_tp.wire.runtime import Insert
folder, weights, out = Path(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[5]
joining, decode_steps = int(sys.argv[3]), int(sys.argv[4])
group = init_ring()
spec = load_spec(folder)
plan = plan_tensor_parallel(spec, weights)
model = load_shard(folder, plan, group.rank(), group, mx.float32)
eos = load_tokenizer(folder).eos_token_ids
rng = np.random.default_rng(0)
vocab = spec.vocab_size
def greedy(lp):
    return mx.argmax(lp, axis=-1).astype(mx.uint32), 0
def batch(budget, chunk, fused, ratio=0.0):
    options = ServingOptions(
        max_concurrency=8, prompt_cache_size=0, step_token_budget=budget, prefill_step_size=chunk,
        chunk_attention_ratio=ratio,
    )
    one_pass = FusedForward(model, spec.model_type) if fused else None
    return LockstepBatch(model, [], options, greedy, bytes_per_token=0, fused=one_pass)
def run(budget, streams, long, chunk=512, fused=False, ratio=0.0):
    b, uid = batch(budget, chunk, fused, ratio), 0
    for _ in range(streams):
        ids = tuple(rng.integers(0, vocab, 64).tolist())
        b.insert(Insert(uid=uid, tokens=ids, max_tokens=100000))
        uid += 1
    while streams and b.steps < 4 * streams + 4:
        b.step()  # every stream prefilled and decoding
    gaps, joined, first, steps = [], None, None, 0
    if long:
        joined = time.perf_counter()
        ids = tuple(rng.integers(0, vocab, joining).tolist())
        b.insert(Insert(uid=uid, tokens=ids, max_tokens=1))
    while True:
        t = time.perf_counter()
        responses = b.step()
        gaps.append(time.perf_counter() - t)
        steps += 1
        if long and any(r.uid == uid for r in responses):
            first = time.perf_counter() - joined
            break
        if not long and steps >= decode_steps:
            break
    b.close()
    worst = sorted(range(len(gaps)), key=lambda i: -gaps[i])[:3]
    return dict(
        itl_p50=float(np.median(gaps)), itl_p90=float(np.percentile(gaps, 90)),
        itl_max=float(max(gaps)), first=first, steps=steps,
        worst=[(i, round(gaps[i], 3)) for i in worst],  # (step, seconds): where the max is
    )
result = {}
result["decode_alone"] = run(None, 4, False)
result["prefill_alone"] = run(None, 0, True)
# the budget's rule: a chunk costing about one decode step (decode step x prefill tokens/s)
rate = joining / result["prefill_alone"]["first"]
budget = max(16, min(512, round(result["decode_alone"]["itl_p50"] * rate)))
# rank 0's: each rank timed its own steps, and ranks stepping different chunks would wait in
# collectives of different shapes for ever
budget = int(mx.distributed.all_sum(mx.array(budget if group.rank() == 0 else 0), group=group))
result["budget"] = budget
priced_only = json.loads(sys.argv[7])
if not priced_only:
    result["chunks_512"] = run(None, 4, True)
    result["chunks_budget"] = run(budget, 4, True)
    result["chunks_budget_one_pass"] = run(budget, 4, True, fused=True)
# issue #60: the leader's default since, a chunk costing PREFILL_GAP - 1 decode steps at
# position 0 (exo_tp.plan.step_budget.step_token_budget) and priced at its position
# (attention_ratio), never under MIN_CHUNK tokens
per_step = (PREFILL_GAP - 1) * result["decode_alone"]["itl_p50"] * rate
priced = max(MIN_CHUNK, min(512, round(per_step)))
priced = int(mx.distributed.all_sum(mx.array(priced if group.rank() == 0 else 0), group=group))
result["priced_budget"] = priced
result["chunks_priced"] = run(priced, 4, True, ratio=attention_ratio(spec))
result["one_pass"] = {str(c): run(c, 4, True, fused=True) for c in json.loads(sys.argv[6])}
if group.rank() == 0:
    Path(out).write_text(json.dumps(result))
barrier(group)
"""


def decoding_during_prefill(
    model: Path,
    joining: int,
    decode_steps: int,
    budgets: list[int],
    link_delay: float = 0.0,
    priced_only: bool = False,
) -> dict[str, object]:
    """Inter-token p50 of 4 decoding streams during a ``joining``-token prefill, and the
    prefill's time to its first token, against each alone (one ring job, 2 uneven ranks);
    and with one pass a step at each budget in ``budgets`` (module doc). ``link_delay``
    (seconds): each rank reaches the other through a delaying proxy (bench/_delayed_link.py)."""
    sys.path.insert(0, str(ROOT))
    from exo_tp.process.blas import share_cores
    from exo_tp.transport.ports import free_ports
    from exo_tp.transport.ring import ring_env, write_hostfile

    with tempfile.TemporaryDirectory() as tmp:
        out, ports = Path(tmp) / "out.json", free_ports(4)
        real, proxied = ports[:2], ports[2:] if link_delay else ports[:2]
        links = [
            subprocess.Popen(
                [sys.executable, str(BENCH / "_delayed_link.py"), str(proxied[r]), str(real[r])]
                + [str(link_delay)]
            )
            for r in range(2)
            if link_delay
        ]
        hostfiles = [Path(tmp) / f"hosts-{r}.json" for r in range(2)]
        for r, hostfile in enumerate(hostfiles):  # its own port, the peer's through the link
            mine = [real[j] if j == r else proxied[j] for j in range(2)]
            write_hostfile(hostfile, [f"127.0.0.1:{p}" for p in mine])
        args = [
            str(model),
            json.dumps(WEIGHTS),
            str(joining),
            str(decode_steps),
            str(out),
            json.dumps(budgets),
            json.dumps(priced_only),
        ]
        base = env()
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _RING, *args],
                # each rank its share of the cores for OpenBLAS, as exo-tp's ranks (two
                # threads each on two cores measured every step 2-3x slower, its cost noise)
                env={**base, **share_cores(2, base), **ring_env(r, hostfiles[r])},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(2)
        ]
        try:  # a rank that fails leaves the other waiting in a collective: stop both then
            while any(p.poll() is None for p in procs):
                failed = [p for p in procs if p.poll()]
                if failed:
                    raise SystemExit(f"a rank failed: {failed[0].stderr.read()[-2000:]}")
                time.sleep(0.2)
            failed = [p for p in procs if p.returncode]
            if failed:
                raise SystemExit(f"a rank failed: {failed[0].stderr.read()[-2000:]}")
        finally:
            for proc in procs + links:
                proc.kill()
        r = json.loads(out.read_text())
    alone, prefill = r["decode_alone"]["itl_p50"], r["prefill_alone"]["first"]
    names = ("chunks_512", "chunks_budget", "chunks_budget_one_pass", "chunks_priced")
    cases = {name: r[name] for name in names if name in r}
    cases.update({f"one_pass_{c}": case for c, case in r["one_pass"].items()})
    for case in cases.values():
        case["itl_over_alone"] = round(case["itl_p50"] / alone, 3)
        case["max_gap_over_alone"] = round(case["itl_max"] / alone, 3)
        case["prefill_over_alone"] = round(case["first"] / prefill, 3)
    if priced_only:
        return r
    r["one_pass_over_two"] = {
        "itl": round(r["chunks_budget_one_pass"]["itl_p50"] / r["chunks_budget"]["itl_p50"], 3),
        "prefill": round(r["chunks_budget_one_pass"]["first"] / r["chunks_budget"]["first"], 3),
    }
    r["budgets_meeting_both_targets"] = [
        int(c)
        for c, case in r["one_pass"].items()
        if case["itl_over_alone"] <= 1.5 and case["prefill_over_alone"] <= 1.3
    ]
    return r


def per_sequence_price(model: Path, prompt: int, steps: int) -> dict[str, float]:
    """Median decode step of 4 streams, float batched against 8-bit KV one sequence at a time
    (one device, in this process)."""
    sys.path.insert(0, str(ROOT))
    import mlx.core as mx
    import numpy as np

    from exo_tp.plan.spec import load_spec
    from exo_tp.plan.tensor_parallel import plan_tensor_parallel
    from exo_tp.runtime.batching import LockstepBatch
    from exo_tp.shard.apply import load_shard
    from exo_tp.shard.kv_quant import quantize_kv
    from exo_tp.wire.assignment import ServingOptions
    from exo_tp.wire.runtime import Insert

    spec = load_spec(model)
    group = 64 if spec.head_dim % 64 == 0 else 32  # the quick model's heads are 32 wide
    out = {}
    for bits in (None, 8):
        plan = plan_tensor_parallel(spec, [1.0])
        shard = load_shard(model, plan, 0, mx.distributed.init(), mx.float32)
        if bits:
            quantize_kv(shard, bits, group, 0)
        options = ServingOptions(
            max_concurrency=8, prompt_cache_size=0, kv_bits=bits, kv_group_size=group
        )
        batch = LockstepBatch(
            shard,
            [],
            options,
            lambda lp: (mx.argmax(lp, axis=-1).astype(mx.uint32), 0),
            bytes_per_token=0,
        )
        rng = np.random.default_rng(0)
        for uid in range(STREAMS):
            ids = tuple(rng.integers(0, spec.vocab_size, prompt).tolist())
            batch.insert(Insert(uid=uid, tokens=ids, max_tokens=100000))
        while len(batch.generator._generation_batch) < STREAMS:
            batch.step()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            batch.step()
            times.append(time.perf_counter() - t)
        batch.close()
        out[f"{bits or 32}-bit_step_p50"] = round(float(np.median(times)), 4)
    out["kv8_over_float"] = round(out["8-bit_step_p50"] / out["32-bit_step_p50"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="layers of the SmolLM2-wide model")
    parser.add_argument("--prompt", type=int, default=16384, help="first-token prompt length")
    parser.add_argument("--joining", type=int, default=8192, help="the prompt joining 4 streams")
    parser.add_argument("--decode-steps", type=int, default=24)
    parser.add_argument("--quick", action="store_true", help="every path, cheaply")
    parser.add_argument(
        "--link-delay-ms",
        type=float,
        default=0.0,
        help="part 3: each rank reaches the other through a proxy delaying every chunk this "
        "long (bench/_delayed_link.py: a slow link, where collectives cost about a ms)",
    )
    parser.add_argument(
        "--one-pass-budgets",
        default=",".join(map(str, FUSED_BUDGETS)),
        help="part 3: the budgets tried with one pass a step (comma-separated; '' for none)",
    )
    parser.add_argument(
        "--priced-only",
        action="store_true",
        help="part 3: only the time-priced budget (the default's) against alone",
    )
    parser.add_argument(
        "--only",
        choices=[
            "kv_bytes_per_1k_tokens_smollm2",
            "first_token",
            "decoding_during_prefill",
            "per_sequence_price",
        ],
        help="run one part",
    )
    args = parser.parse_args()
    smollm2 = resolve("smollm2-135m")
    pairs = list(QUICK) if args.quick else [f"num_hidden_layers={args.layers}"]
    if args.quick:
        args.prompt, args.joining, args.decode_steps = 256, 256, 4
    pairs.append(f"max_position_embeddings={max(args.prompt, args.joining) + 64}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="long-context-") as tmp:
        model = build(smollm2, Path(tmp) / "model", pairs)
        parts = {
            "kv_bytes_per_1k_tokens_smollm2": lambda: kv_bytes(smollm2),
            "first_token": lambda: first_token(model, args.prompt),
            "decoding_during_prefill": lambda: decoding_during_prefill(
                model,
                args.joining,
                args.decode_steps,
                [16, 64] if args.quick else [int(b) for b in args.one_pass_budgets.split(",") if b],
                args.link_delay_ms / 1000,
                args.priced_only,
            ),
            "per_sequence_price": lambda: per_sequence_price(
                model, 64 if args.quick else 1024, args.decode_steps
            ),
        }
        result: dict[str, object] = {
            "machine": {"cores": os.cpu_count(), "load": os.getloadavg()[0]}
        }
        for name, part in parts.items():
            if args.only in (None, name):
                result[name] = part()
        result["model"] = {"layers": 2 if args.quick else args.layers, "pairs": pairs}
    result["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
