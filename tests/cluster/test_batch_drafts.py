"""Drafts inside a batch (exo_tp.runtime.batch_verify, issue #61 point 4): while several
streams decode, each drafts by prompt lookup and all are verified in one batched step, each
with its own acceptance; every stream's answer stays greedy decoding's.

In this process on one LockstepBatch over SmolLM2 (float32): three streams of unequal length
against the same streams decoded without drafts (and the first against single-device
mlx-lm); on a 2-node cluster (`--batch-drafts on`): three concurrent chat requests, each
against single-device mlx-lm, drafts kept while they ran together.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
from helpers import _single_device, mlx_lm_reference
from test_speculative import greedy_batch

from exo_tp.models.registry import resolve_model
from exo_tp.plan.spec import load_spec
from exo_tp.plan.tensor_parallel import plan_tensor_parallel
from exo_tp.shard.apply import load_shard
from exo_tp.wire.assignment import ServingOptions
from exo_tp.wire.runtime import Insert

TEXTS = (
    "Repeat this list exactly: apple banana cherry date elderberry fig grape apple banana",
    "Repeat: one two three four five six seven eight nine ten one two three",
    "Say: the quick brown fox jumps over the lazy dog; the quick brown fox",
)


def _decode_together(
    model: Any, tokenizer: Any, rows: bool, drafts: int
) -> tuple[dict[int, list[int]], list[tuple[int, int, int]]]:
    """The three prompts decoded together: each stream's tokens, and each verify step's
    (streams in the batch, drafted, accepted)."""
    options = ServingOptions(max_concurrency=4, prompt_cache_size=4, num_draft_tokens=drafts)
    batch = greedy_batch(model, list(tokenizer.eos_token_ids), options, verify_rows=rows)
    steps: list[tuple[int, int, int]] = []
    batch.on_drafts = lambda uid, drafted, kept: steps.append((len(batch.active), drafted, kept))
    tokens: dict[int, list[int]] = {i: [] for i in range(len(TEXTS))}
    for i, text in enumerate(TEXTS):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        batch.insert(
            Insert(uid=i, tokens=tuple(prompt), max_tokens=24 + 8 * i, draft_tokens=drafts)
        )
    while not batch.idle:
        for response in batch.step():
            tokens[response.uid].append(response.token)
    return tokens, steps


def test_streams_verified_together_keep_their_greedy_answers(
    default_models: dict[str, Path],
) -> None:
    folder = resolve_model("smollm2-135m")
    _, tokenizer = _single_device(str(folder))
    plan = plan_tensor_parallel(load_spec(folder), [1.0])
    model = load_shard(folder, plan, 0, mx.distributed.init(), mx.float32)
    plain, _ = _decode_together(model, tokenizer, rows=False, drafts=0)
    together, steps = _decode_together(model, tokenizer, rows=True, drafts=4)
    several = [s for s in steps if s[0] > 1]
    assert several and sum(kept for _, _, kept in several) > 0, steps
    assert sum(drafted - kept for _, drafted, kept in several) > 0  # rows rejected too
    assert together == plain
    reference = mlx_lm_reference(default_models["smollm2-135m"], TEXTS[0], 24)
    assert together[0] == reference.tokens


def test_a_cluster_verifies_concurrent_requests_together(
    tmp_path: Path, default_models: dict[str, Path]
) -> None:
    """Three concurrent greedy chats on 2 uneven nodes with --batch-drafts on: the ranks
    verified several streams' drafts in one step (their log says so), and each answer is
    single-device mlx-lm's."""
    from cluster_helpers import http_json, local_cluster

    references = [mlx_lm_reference(default_models["smollm2-135m"], t, 24) for t in TEXTS]
    extra = ("--batch-drafts", "on", "--num-draft-tokens", "4")
    answers: dict[int, Any] = {}
    log = tmp_path / "cluster.log"
    with local_cluster(2, weights=[0.6, 0.4], extra=extra, log=log) as cluster:

        def ask(i: int) -> None:
            body = {
                "model": "smollm2-135m",
                "messages": [{"role": "user", "content": TEXTS[i]}],
                "max_tokens": 24,
                "temperature": 0,
            }
            answers[i] = http_json(cluster.urls[i % 2] + "/v1/chat/completions", body, 300)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(TEXTS))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        _, view = http_json(cluster.urls[0] + "/v1/cluster")
    for i, reference in enumerate(references):
        status, answer = answers[i]
        assert status == 200, answer
        assert answer["choices"][0]["message"]["content"] == reference.text
    assert view["serving"]["accepted_tokens"] > 0, view["serving"]
    assert "verified the drafts of 3 streams together" in log.read_text()
