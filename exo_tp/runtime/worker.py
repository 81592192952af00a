"""One rank of a local launch: join its stage's ring, load its shard, generate, report.

Run as ``python -m exo_tp.runtime.worker JOB.json`` with EXO_TP_RANK (global rank) and, for a
stage of several ranks, MLX_RANK / MLX_HOSTFILE set. The last stage's first rank writes the
generated text to stdout; logs go to stderr.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.utils import load_tokenizer

from exo_tp.runtime.generation import encode_prompt, generate
from exo_tp.runtime.job import RANK_ENV, READY, LaunchJob
from exo_tp.runtime.lifecycle import die_with_parent
from exo_tp.runtime.pipeline import stage_driver
from exo_tp.runtime.ring import barrier, init_ring
from exo_tp.shard.apply import load_shard
from exo_tp.shard.collectives import gather_padded

log = logging.getLogger("exo_tp.worker")

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16, "auto": None}
HOP_TIMEOUT = 120.0


def _memory_by_rank(group: mx.distributed.Group, load_peak: int) -> list[dict[str, int]]:
    """Every rank's memory (peak while loading, peak overall, resident now), on every rank."""
    mine = mx.array([load_peak, mx.get_peak_memory(), mx.get_active_memory()], dtype=mx.float32)
    everyone = gather_padded(mine, [3] * group.size(), group)
    mx.eval(everyone)
    rows = everyone.reshape(group.size(), 3).tolist()
    return [{"load_peak": int(a), "peak": int(b), "active": int(c)} for a, b, c in rows]


def run(job: LaunchJob) -> None:
    rank = int(os.environ.get(RANK_ENV, "0"))
    index, local = job.plan.locate(rank)
    stages = job.plan.stages
    stage, first, last = stages[index], index == 0, index == len(stages) - 1
    group = init_ring()  # before loading: a peer that never comes must not cost a load first
    print(READY, file=sys.stderr, flush=True)
    started = time.perf_counter()
    model = load_shard(Path(job.model_dir), stage.tp, local, group, DTYPES[job.dtype],
                       stage.layers, first, last,
                       Path(job.adapter_path) if job.adapter_path else None)
    load_peak = mx.get_peak_memory()
    mine = stage.tp.ranks[local]
    log.info("stage %d/%d layers %d-%d, shard loaded in %.1fs: q heads %d-%d, kv %s, ffn %s, "
             "vocab %d-%d, %.0f MB active", index + 1, len(stages), stage.layers.start,
             stage.layers.stop, time.perf_counter() - started, mine.heads.q_heads.start,
             mine.heads.q_heads.stop, list(mine.heads.kv_heads),
             {k: (s.start, s.stop) for k, s in mine.ffn.items()}, mine.vocab.start,
             mine.vocab.stop, mx.get_active_memory() / 1e6)
    driver = stage_driver(model, job.plan, rank, job.hops, HOP_TIMEOUT)
    if driver is None:  # an earlier stage: served until the last stage closed its link
        barrier(group)
        return
    _generate_and_report(job, driver, group, local, load_peak)
    barrier(group)


def _generate_and_report(job: LaunchJob, model: Any, group: mx.distributed.Group, local: int,
                         load_peak: int) -> None:
    tokenizer = load_tokenizer(Path(job.model_dir))
    prompt = encode_prompt(tokenizer, job.prompt, None, job.use_chat_template)
    speaker = local == 0
    if job.logits_out:
        logits = model(mx.array(prompt)[None]).astype(mx.float32)
        mx.eval(logits)
        if speaker:
            np.save(job.logits_out, np.array(logits[0]))
    tokens: list[int] = []
    last = None
    for response in generate(model, tokenizer, prompt, job.sampling, group):
        tokens.append(response.token)
        last = response
        if speaker:
            sys.stdout.write(response.text)
            sys.stdout.flush()
    memory = _memory_by_rank(group, load_peak)
    if not speaker:
        return
    sys.stdout.write("\n")
    sys.stdout.flush()
    if last is not None:
        log.info("prompt %d tokens at %.1f tok/s; generated %d tokens at %.2f tok/s",
                 last.prompt_tokens, last.prompt_tps, last.generation_tokens,
                 last.generation_tps)
    if job.report_out:
        text = tokenizer.decode([t for t in tokens if t not in tokenizer.eos_token_ids])
        report = {
            "tokens": tokens,
            "text": text,
            "prompt_tokens": len(prompt),
            "generation_tps": last.generation_tps if last else 0.0,
            "finish_reason": last.finish_reason if last else None,
            "memory_by_rank": memory,
        }
        Path(job.report_out).write_text(json.dumps(report))


def main() -> None:
    die_with_parent()
    rank = os.environ.get(RANK_ENV, "0")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s rank {rank} %(levelname)s %(message)s")
    job = LaunchJob.model_validate_json(Path(sys.argv[1]).read_text())
    run(job)


if __name__ == "__main__":
    main()
