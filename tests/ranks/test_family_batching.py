"""Every family's caches under the runtime's continuous batching and prompt cache.

Tensor parallelism is checked by the matrix (tests/ranks/test_arch_matrix.py); what a family adds to
serving is its caches: rotating windows, MLA's latent cache, DeepSeek Sparse Attention's
CacheList, Gemma 4's shared KV, chunked attention. Here each family's tiny checkpoint runs whole
in this process, loaded by the engine's own loader on one rank, through the runtime's
`LockstepBatch` (mlx-lm's batch generator plus exo-tp's
admission order, prompt cache and lockstep), with three prompts of different lengths joining one
batch, then a second turn that extends the first conversation and must be served from the prompt
cache. Every stream's greedy tokens must equal mlx-lm's `stream_generate` on that prompt alone,
up to the first step whose reference choice is a near-tie (batched sums may decide a near-tie
the other way; the tiny models are random).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from arch_configs import ARCHS, tiny_config
from helpers import greedy_batch
from ring_harness import run_on_ranks
from test_arch_matrix import MIN_MARGIN, SEEDS
from tiny_models import write_tiny_model

from exo_tp.plan.spec import load_spec
from exo_tp.plan.tensor_parallel import plan_tensor_parallel
from exo_tp.shard.apply import load_shard
from exo_tp.wire.runtime import Insert, Remove

TOKENS = 6
PROMPTS = ["Hi.", "Write a short poem about the sea.", "Name three colors, then count to five."]
FOLLOW_UP = " And now one more line, please."


def _reference(model: object, tokenizer: object, ids: list[int]) -> tuple[list[int], list[float]]:
    """mlx-lm's own greedy tokens for one prompt alone, with each step's top-2 margin."""
    from mlx_lm import stream_generate

    tokens, margins = [], []
    for response in stream_generate(model, tokenizer, mx.array(ids), max_tokens=TOKENS):
        tokens.append(response.token)
        top2 = np.partition(np.array(response.logprobs.astype(mx.float32)), -2)[-2:]
        margins.append(float(top2[1] - top2[0]))
    return tokens, margins


def _assert_same_until_a_tie(ours: list[int], reference: tuple[list[int], list[float]]) -> None:
    tokens, margins = reference
    decided = next((i for i, m in enumerate(margins) if m < MIN_MARGIN), len(tokens))
    assert decided > 0, "the reference's first token is a near-tie: change the prompt"
    assert ours[:decided] == tokens[:decided], (ours, tokens, margins)


def _run(batch: object, prompts: list[list[int]], first_uid: int) -> tuple[dict, dict]:
    cached = {}
    for i, ids in enumerate(prompts):
        change = Insert(uid=first_uid + i, tokens=tuple(ids), max_tokens=TOKENS)
        cached[change.uid] = batch.insert(change).cached  # type: ignore[attr-defined]
    out: dict[int, list[int]] = {first_uid + i: [] for i in range(len(prompts))}
    while not batch.idle:  # type: ignore[attr-defined]
        for response in batch.step():  # type: ignore[attr-defined]
            out[response.uid].append(response.token)
    return out, cached


@pytest.mark.parametrize("arch", list(ARCHS))
def test_batched_streams_and_a_cached_turn_equal_mlx_lm(
    tmp_path: Path, default_models: dict[str, Path], arch: str
) -> None:
    from mlx_lm import load

    folder = write_tiny_model(
        tmp_path / arch,
        tiny_config(arch),
        default_models["smollm2-135m"],
        seed=SEEDS.get(arch, 0),
    )
    model, tokenizer = load(str(folder))  # the reference
    model.set_dtype(mx.float32)
    plan = plan_tensor_parallel(load_spec(folder), [1.0])
    ours = load_shard(folder, plan, 0, mx.distributed.init(), mx.float32)
    ids = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        for p in PROMPTS
    ]
    batch = greedy_batch(ours, tokenizer, prompt_cache_size=4)
    try:
        first, _ = _run(batch, ids, 0)
        for uid, prompt in enumerate(ids):
            _assert_same_until_a_tie(first[uid], _reference(model, tokenizer, prompt))
        # the first conversation goes on: its prompt, its answer, a follow-up
        turn = ids[1] + first[1] + tokenizer.encode(FOLLOW_UP, add_special_tokens=False)
        second, cached = _run(batch, [turn], len(ids))
    finally:
        batch.close()
    assert cached[len(ids)] >= len(ids[1]), cached  # the first turn came from the prompt cache
    _assert_same_until_a_tie(second[len(ids)], _reference(model, tokenizer, turn))


# Families whose caches hold a recurrent state (mlx-lm's ArraysCache), which cannot be trimmed
RECURRENT = ["kimi_k3", "qwen3_5", "qwen3_next", "nemotron_h", "lfm2"]


@pytest.mark.parametrize("arch", RECURRENT)
def test_a_cancelled_stream_leaves_no_stale_recurrent_state(
    tmp_path: Path, default_models: dict[str, Path], arch: str
) -> None:
    """A stream removed mid-generation (a client's cancel, or a stop string) leaves its
    advanced recurrent state in the prompt cache: a prompt that shares only its prompt starts
    afresh (reusing that state gives other tokens: 4 of these 5 families fail so), and one
    that extends what the client saw of it gives mlx-lm's tokens too."""
    from mlx_lm import load

    folder = write_tiny_model(
        tmp_path / arch, tiny_config(arch), default_models["smollm2-135m"], seed=SEEDS.get(arch, 0)
    )
    model, tokenizer = load(str(folder))  # the reference
    model.set_dtype(mx.float32)
    plan = plan_tensor_parallel(load_spec(folder), [1.0])
    ours = load_shard(folder, plan, 0, mx.distributed.init(), mx.float32)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPTS[1]}], add_generation_prompt=True
    )
    follow_up = tokenizer.encode(FOLLOW_UP, add_special_tokens=False)
    batch = greedy_batch(ours, tokenizer, prompt_cache_size=4)
    try:
        batch.insert(Insert(uid=0, tokens=tuple(prompt), max_tokens=100))
        seen: list[int] = []
        while len(seen) < 3:
            seen += [r.token for r in batch.step() if r.uid == 0]
        batch.remove(Remove(uids=(0,)))
        other = prompt + follow_up  # the same prompt, another continuation
        elsewhere, cached = _run(batch, [other], 1)
        assert cached[1] == 0  # the entry covers tokens this prompt lacks: no reuse
        extended = prompt + seen + follow_up
        resumed, _ = _run(batch, [extended], 2)
    finally:
        batch.close()
    _assert_same_until_a_tie(elsewhere[1], _reference(model, tokenizer, other))
    _assert_same_until_a_tie(resumed[2], _reference(model, tokenizer, extended))


# Each rank batches its shard in lockstep (same inserts, same steps; every rank samples the
# same argmax from the gathered logits), model after model in one ring job; rank 0 reports
# each model's streams and cached turn.
_RING_BATCH = """
import json
import sys
sys.path[:0] = [{tests!r}, {here!r}]  # the shared helpers, and this module
from pathlib import Path
from mlx_lm.tokenizer_utils import load as load_tokenizer
from helpers import greedy_batch
from test_family_batching import _run
from exo_tp.plan.spec import load_spec
from exo_tp.plan.tensor_parallel import plan_tensor_parallel
from exo_tp.shard.apply import load_shard
prompts = {prompts!r}
outs = {{}}
for name, folder in {folders!r}.items():
    folder = Path(folder)
    plan = plan_tensor_parallel(load_spec(folder), {weights!r})
    model = load_shard(folder, plan, group.rank(), group, mx.float32)
    batch = greedy_batch(model, load_tokenizer(folder), prompt_cache_size=4)
    first, _ = _run(batch, prompts, 0)
    turn = prompts[1] + first[1] + {follow_up!r}
    second, cached = _run(batch, [turn], len(prompts))
    batch.close()
    outs[name] = dict(first=first, second=second, cached=cached, turn=turn)
if group.rank() == 0:
    Path(OUT).write_text(json.dumps(outs))
"""


def test_recurrent_families_batch_on_uneven_ranks_one_holding_no_linear_attention_heads(
    tmp_path: Path, default_models: dict[str, Path]
) -> None:
    """Recurrent caches split by heads under continuous batching and the prompt cache, Kimi
    K3's (KDA) and Qwen 3.5's (Gated DeltaNet: key heads with their value heads), one ring
    job: 3 ranks holding 2, 1 and 0 of the 3 linear-attention (key) heads (the last one's
    stand-in keeps its caches in step through the batch's merges, filters and extractions)
    give mlx-lm's tokens, and the second turn resumes from the first turn's state."""
    from mlx_lm import load

    weights = [0.6, 0.4, 0.0]
    folders, references = {}, {}
    for arch in ("kimi_k3", "qwen3_5"):
        folder = write_tiny_model(
            tmp_path / arch, tiny_config(arch), default_models["smollm2-135m"]
        )
        shards = plan_tensor_parallel(load_spec(folder), weights).ranks
        assert [s.linear_heads.size for s in shards] == [2, 1, 0]
        model, tokenizer = load(str(folder))
        model.set_dtype(mx.float32)
        folders[arch], references[arch] = str(folder), (model, tokenizer)
    # one tokenizer (SmolLM2's, trimmed) for both: the same prompt ids
    ids = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        for p in PROMPTS
    ]
    follow_up = tokenizer.encode(FOLLOW_UP, add_special_tokens=False)
    script = _RING_BATCH.format(
        tests=str(Path(__file__).resolve().parents[1]),
        here=str(Path(__file__).resolve().parent),
        folders=folders,
        weights=weights,
        prompts=ids,
        follow_up=follow_up,
    )
    outs = run_on_ranks(len(weights), script, tmp_path, timeout=300)
    for arch, (model, tokenizer) in references.items():
        out = outs[arch]
        for uid, prompt in enumerate(ids):
            _assert_same_until_a_tie(out["first"][str(uid)], _reference(model, tokenizer, prompt))
        turn = out["turn"]
        assert turn == ids[1] + out["first"]["1"] + follow_up
        assert out["cached"][str(len(ids))] >= len(ids[1])  # the first turn came from the cache
        _assert_same_until_a_tie(out["second"][str(len(ids))], _reference(model, tokenizer, turn))
