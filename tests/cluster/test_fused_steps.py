"""Fused steps (exo_tp.shard.fused_step): a step's decode rows and a prompt chunk in one pass.

Every family whose blocks fuse runs in one ring job of 3 uneven ranks, one of them holding
nothing (its attention and MLP are zero stand-ins that still join every all-reduce): three
streams decode while a 300-token prompt joins them and is read in budgeted chunks, each chunk
in the same forward pass as the streams' rows. Every stream's greedy tokens must equal mlx-lm's
`stream_generate` on that prompt alone, up to the reference's first near-tie. Then a node
cluster started with `--fused-steps on` serves a long prompt beside a running stream through the
official OpenAI client, both answers equal to mlx-lm's.
"""

from __future__ import annotations

import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
from arch_configs import tiny_config
from cluster_helpers import local_cluster, wait_for_log
from helpers import mlx_lm_reference
from openai import OpenAI
from ring_harness import run_on_ranks
from test_arch_matrix import MIN_MARGIN
from tiny_models import write_tiny_model

from exo_tp.arch import table_for

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "smollm3")
WEIGHTS = [0.6, 0.4, 0.0]  # the last rank holds no heads and no FFN rows
TOKENS = 24  # the streams outlast the long prompt's ~15 chunks
SHORT = (20, 30, 40)  # the streams decoding when the long prompt joins
LONG = 300
BUDGET = 24  # the long prompt's chunks: 21 tokens beside the three streams' rows

_RING = """
import json
from pathlib import Path
from exo_tp.plan.spec import load_spec
from exo_tp.plan.tensor_parallel import plan_tensor_parallel
from exo_tp.runtime.batching import LockstepBatch
from exo_tp.shard.apply import load_shard
from exo_tp.shard.fused_step import FusedForward
from exo_tp.wire.assignment import ServingOptions
from exo_tp.wire.runtime import Insert
out = {{}}
for family, folder, prompts in {cases!r}:
    spec = load_spec(Path(folder))
    plan = plan_tensor_parallel(spec, {weights!r})
    model = load_shard(Path(folder), plan, group.rank(), group, mx.float32)
    options = ServingOptions(max_concurrency=4, prompt_cache_size=0, step_token_budget={budget})
    batch = LockstepBatch(
        model, [], options, lambda lp: (mx.argmax(lp, axis=-1).astype(mx.uint32), 0),
        bytes_per_token=0, fused=FusedForward(model, spec.model_type),
    )
    streams = {{uid: [] for uid in range(len(prompts))}}
    for uid, ids in enumerate(prompts[:-1]):
        batch.insert(Insert(uid=uid, tokens=tuple(ids), max_tokens={tokens}))
    while any(not streams[uid] for uid in range(len(prompts) - 1)):  # all three decode
        for response in batch.step():
            streams[response.uid].append(response.token)
    last = len(prompts) - 1
    batch.insert(Insert(uid=last, tokens=tuple(prompts[last]), max_tokens={tokens}))
    while not batch.idle:
        for response in batch.step():
            streams[response.uid].append(response.token)
    batch.close()
    out[family] = dict(tokens=[streams[u] for u in range(len(prompts))], fused=batch.fused_steps)
if group.rank() == 0:
    Path(OUT).write_text(json.dumps(out))
"""


def _same_until_a_tie(model: object, tokenizer: object, ids: list[int], ours: list[int]) -> int:
    """How many leading tokens equal mlx-lm's for ``ids`` alone (before its first near-tie)."""
    from mlx_lm import stream_generate

    tokens, margins = [], []
    for response in stream_generate(model, tokenizer, mx.array(ids), max_tokens=TOKENS):
        tokens.append(response.token)
        top2 = np.partition(np.array(response.logprobs.astype(mx.float32)), -2)[-2:]
        margins.append(float(top2[1] - top2[0]))
    decided = next((i for i, m in enumerate(margins) if m < MIN_MARGIN), len(tokens))
    assert ours[:decided] == tokens[:decided], (ours, tokens, margins)
    return decided


def test_every_fusing_family_decodes_beside_a_chunk_as_mlx_lm_on_uneven_ranks(
    tmp_path: Path, default_models: dict[str, Path]
) -> None:
    from mlx_lm import load

    assert all(table_for(tiny_config(f)["model_type"]).fused for f in FAMILIES)
    rng = np.random.default_rng(0)
    cases, folders = [], {}
    for family in FAMILIES:
        config = {**tiny_config(family), "max_position_embeddings": 1024}
        folder = write_tiny_model(tmp_path / family, config, default_models["smollm2-135m"])
        prompts = [rng.integers(0, config["vocab_size"], n).tolist() for n in (*SHORT, LONG)]
        cases.append((family, str(folder), prompts))
        folders[family] = folder
    script = _RING.format(cases=cases, weights=WEIGHTS, budget=BUDGET, tokens=TOKENS)
    outs = run_on_ranks(len(WEIGHTS), script, tmp_path, timeout=600)
    compared = {}
    for family, folder, prompts in cases:
        result = outs[family]
        # the long prompt's chunks ran beside the streams (LONG / (BUDGET - 3) of them)
        assert result["fused"] >= LONG // BUDGET, (family, result["fused"])
        model, tokenizer = load(folder)
        model.set_dtype(mx.float32)
        for ids, ours in zip(prompts, result["tokens"], strict=True):
            compared[family, len(ids)] = _same_until_a_tie(model, tokenizer, ids, ours)
    print(compared)
    assert sum(compared.values()) >= len(compared) * TOKENS // 2, compared


def test_a_node_cluster_with_fused_steps_serves_a_long_prompt_beside_a_stream(
    default_models: dict[str, Path],
) -> None:
    """`exo-tp run --fused-steps on` (2 uneven nodes, SmolLM2): a long prompt sent while a
    stream decodes is read in 24-token chunks fused with the stream's rows (the rank logs
    it); both answers equal single-device mlx-lm's."""
    running_prompt = "Tell me a long story about a lighthouse keeper and a storm."
    long_prompt = "Summarise this in one word: " + " ".join(
        f"item {i} is a red apple on a green table;" for i in range(60)
    )
    extra = ("--fused-steps", "on", "--step-token-budget", "24", "--max-concurrency", "4")
    with local_cluster(2, weights=[0.6, 0.4], extra=extra) as cluster:
        start = cluster.log.stat().st_size
        client = OpenAI(base_url=f"{cluster.urls[0]}/v1", api_key="x", max_retries=0, timeout=300)
        answers: dict[str, str] = {}

        def ask_long() -> None:
            reply = client.chat.completions.create(
                model="smollm2-135m",
                messages=[{"role": "user", "content": long_prompt}],
                max_tokens=6,
                temperature=0,
            )
            answers["long"] = reply.choices[0].message.content or ""

        stream = client.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": running_prompt}],
            max_tokens=64,
            temperature=0,
            stream=True,
        )
        pieces, joiner = [], threading.Thread(target=ask_long)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                if not joiner.is_alive() and "long" not in answers and len(pieces) == 2:
                    joiner.start()  # joins while the stream decodes
        joiner.join(timeout=300)
        wait_for_log(cluster.log, start, lambda text: "in one pass" in text)
    model = default_models["smollm2-135m"]
    assert "".join(pieces) == mlx_lm_reference(model, running_prompt, 64).text
    assert answers["long"] == mlx_lm_reference(model, long_prompt, 6).text
