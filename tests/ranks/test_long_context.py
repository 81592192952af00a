"""Long contexts (issue #43): a quantized KV cache on uneven ranks, and long prompts.

Every case compares with single-device mlx-lm in float32 (`stream_generate`, with the same
kv_bits, kv_group_size, quantized_kv_start and prefill_step_size when the KV cache is
quantized: mlx-lm quantizes a sequence's cache after the forward call that takes it past
quantized_kv_start, so where its first chunk ends decides what that chunk attended). The long
prompts run on a tiny random llama with SmolLM2's tokenizer (cheap to prefill at 8k tokens), all
in one ring job of 3 uneven ranks; greedy tokens must be identical up to the first step whose
reference choice is a near-tie (random tiny models have some; a near-tie there is fp32 noise).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
from arch_configs import tiny_config
from helpers import launch
from ring_harness import run_on_ranks
from tiny_models import write_tiny_model

WEIGHTS = [0.5, 0.3, 0.2]
STEP = 512  # exo-tp's default --prefill-step-size
TOKENS = 8
# A near-tie: over thousands of tokens of context an uneven split's different summation order
# moves logits by more than over a short prompt (up to ~1e-3 measured on the 8k float case).
MIN_MARGIN = 1e-2


def _reference(model: object, ids: list[int], kv_bits: int | None) -> tuple[list[int], list[float]]:
    """mlx-lm's greedy tokens for ``ids`` alone, with each step's top-2 margin."""
    from mlx_lm import stream_generate

    tokens, margins = [], []
    quantized = dict(kv_bits=kv_bits, kv_group_size=64, quantized_kv_start=0) if kv_bits else {}
    for response in stream_generate(
        model, _TOKENIZER[0], mx.array(ids), max_tokens=TOKENS, prefill_step_size=STEP, **quantized
    ):
        tokens.append(response.token)
        top2 = np.partition(np.array(response.logprobs.astype(mx.float32)), -2)[-2:]
        margins.append(float(top2[1] - top2[0]))
    return tokens, margins


_TOKENIZER: list[object] = []


def _same_until_a_tie(ours: list[int], reference: tuple[list[int], list[float]]) -> int:
    """How many leading tokens were compared (those before the reference's first near-tie)."""
    tokens, margins = reference
    decided = next((i for i, m in enumerate(margins) if m < MIN_MARGIN), len(tokens))
    assert decided > 0, "the reference's first token is a near-tie: change the prompt"
    assert ours[:decided] == tokens[:decided], (ours, tokens, margins)
    return decided


# Each rank loads its shard (once float, once per KV width: quantizing swaps the model's class),
# and batches in lockstep: the long prompts one at a time, then three (and six) prompts of
# different lengths at once. Rank 0 reports every stream's tokens.
_RING = """
import json, sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from mlx_lm.tokenizer_utils import load as load_tokenizer
from exo_tp.plan.spec import load_spec
from exo_tp.plan.tensor_parallel import plan_tensor_parallel
from exo_tp.runtime.batching import LockstepBatch
from exo_tp.shard.apply import load_shard
from exo_tp.shard.fused_step import FusedForward
from exo_tp.shard.kv_quant import quantize_kv
from exo_tp.wire.assignment import ServingOptions
from exo_tp.wire.runtime import Insert
folder = Path({folder!r})
plan = plan_tensor_parallel(load_spec(folder), {weights!r})
eos = load_tokenizer(folder).eos_token_ids
out = {{}}
for name, bits, prompts, budget, together, fused in {cases!r}:
    model = load_shard(folder, plan, group.rank(), group, mx.float32)
    if bits:
        quantize_kv(model, bits, 64, 0)
    options = ServingOptions(
        max_concurrency=6, prompt_cache_size=0, kv_bits=bits, step_token_budget=budget,
        prefill_batch_size=together,
        # chunks priced at their position (the leader's default for a budget): smaller ones
        # further on, the answers the same
        chunk_attention_ratio=0.004 if budget else 0.0,
    )
    batch = LockstepBatch(
        model, eos, options,
        lambda lp: (mx.argmax(lp, axis=-1).astype(mx.uint32), 0), bytes_per_token=0,
        fused=FusedForward(model, "llama") if fused else None,
    )
    for uid, ids in enumerate(prompts):
        batch.insert(Insert(uid=uid, tokens=tuple(ids), max_tokens={tokens}))
    streams = {{uid: [] for uid in range(len(prompts))}}
    widest = 0  # the most streams that gained a token in one step
    while not batch.idle:
        responses = batch.step()
        widest = max(widest, len(responses))
        for response in responses:
            streams[response.uid].append(response.token)
    batch.close()
    out[name] = [streams[uid] for uid in range(len(prompts))]
    out[name + " widest"] = widest
    out[name + " fused"] = batch.fused_steps
# a second turn with an 8-bit KV cache, served from the prompt cache (quantized entries)
model = load_shard(folder, plan, group.rank(), group, mx.float32)
quantize_kv(model, 8, 64, 0)
options = ServingOptions(max_concurrency=4, prompt_cache_size=4, kv_bits=8)
batch = LockstepBatch(
    model, eos, options,
    lambda lp: (mx.argmax(lp, axis=-1).astype(mx.uint32), 0), bytes_per_token=1,
)
turns, cached = [{first_turn!r}], []
for uid in range(2):
    if uid:
        turns.append(turns[0] + out["first turn"] + {follow_up!r})
    hit = batch.insert(Insert(uid=uid, tokens=tuple(turns[uid]), max_tokens={tokens})).cached
    cached.append(hit)
    tokens = []
    while not batch.idle:
        tokens += [r.token for r in batch.step()]
    out["second turn" if uid else "first turn"] = tokens
batch.close()
out["cached"], out["turn"] = cached, turns[1]
if group.rank() == 0:
    Path(OUT).write_text(json.dumps(out))
"""


def test_long_prompts_and_a_quantized_kv_cache_on_uneven_ranks_equal_mlx_lm(
    tmp_path: Path, default_models: dict[str, Path]
) -> None:
    """One ring job of 3 uneven ranks (5/3/2): float prompts of 1k, 4k and 8k tokens, each
    alone; prompts of 1000, 300 and 700 tokens batched together with a step token budget (chunked
    prefill), the chunks in passes of their own and fused with the streams' rows; six prompts
    of 1900, 240, 1300, 600, 1600 and 420 tokens prefilled together and decoding together;
    with an 8-bit and a 4-bit KV cache a 1k prompt alone, then the three batched (8-bit: with
    the budget), each equal to mlx-lm's run of that prompt alone; and a
    second turn of a chat with an 8-bit KV cache, served from the prompt cache, equal to
    mlx-lm's uncached answer."""
    from mlx_lm import load

    config = {**tiny_config("llama"), "max_position_embeddings": 16384}
    folder = write_tiny_model(tmp_path / "llama", config, default_models["smollm2-135m"])
    model, tokenizer = load(str(folder))
    model.set_dtype(mx.float32)
    _TOKENIZER[:] = [tokenizer]
    rng = np.random.default_rng(0)
    vocab = config["vocab_size"]

    def prompt(n: int) -> list[int]:
        return rng.integers(0, vocab, n).tolist()

    long = [prompt(n) for n in (1000, 4000, 8000)]
    batched = [prompt(n) for n in (1000, 300, 700)]
    cases = [
        ("float 1k", None, [long[0]], None, 1, False),
        ("float 4k", None, [long[1]], None, 1, False),
        ("float 8k", None, [long[2]], None, 1, False),
        # chunked prefill with a token budget of 48: the 700 and 1000-token prompts are read
        # in chunks of 47 and 46 tokens beside the streams already decoding, in a pass of
        # their own, then in the same pass as the streams' rows (exo_tp.shard.fused_step)
        ("float budget", None, batched, 48, 1, False),
        ("float fused", None, batched, 48, 1, True),
    ]
    for bits in (8, 4):
        cases += [
            (f"kv{bits} 1k", bits, [long[0]], None, 1, False),
            (f"kv{bits} batched", bits, batched, 48 if bits == 8 else None, 1, False),
        ]
    first_turn, follow_up = batched[1], prompt(44)  # 44: no near-tie in its answer
    # Six at once, the batch's whole width (drawn last: the prompts above keep their tokens),
    # of a few hundred to ~2k tokens, prefilled together in 512-token chunks of six rows (what
    # a node on OpenBLAS does by default), so that steps decode all six at once.
    six = [prompt(n) for n in (1900, 240, 1300, 600, 1600, 420)]
    cases.append(("float six", None, six, None, 6, False))
    script = _RING.format(
        tests=str(Path(__file__).resolve().parents[1]),
        folder=str(folder),
        weights=WEIGHTS,
        cases=cases,
        tokens=TOKENS,
        first_turn=first_turn,
        follow_up=follow_up,
    )
    outs = run_on_ranks(len(WEIGHTS), script, tmp_path, timeout=600)
    compared = {}
    for name, bits, prompts, *_ in cases:
        for i, (ours, ids) in enumerate(zip(outs[name], prompts, strict=True)):
            compared[name, i] = _same_until_a_tie(ours, _reference(model, ids, bits))
    # the second turn reuses the first's quantized cache, and answers as mlx-lm uncached
    assert outs["cached"][1] >= len(first_turn), outs["cached"]
    assert outs["turn"] == first_turn + outs["first turn"] + follow_up
    compared["kv8 cached turn", 0] = _same_until_a_tie(
        outs["second turn"], _reference(model, outs["turn"], 8)
    )
    print(compared)
    # the fused case read its chunks beside the streams in one pass (each of a stream's
    # tokens came with one while a longer prompt waited), the others never did
    assert outs["float fused fused"] >= TOKENS, outs["float fused fused"]
    assert outs["float budget fused"] == 0
    # the six ran at once: one step gave every one of them a token
    assert outs["float six widest"] == len(six), outs["float six widest"]
    assert sum(compared.values()) >= len(compared) * TOKENS // 2, compared
    # the quantized width is not a no-op here: 4 bits change mlx-lm's own tokens
    assert _reference(model, long[0], 4)[0] != _reference(model, long[0], None)[0]


def test_smollm2_with_an_8_bit_kv_cache_on_two_stages_of_uneven_ranks_equals_mlx_lm(
    tmp_path: Path, default_models: dict[str, Path]
) -> None:
    """`exo-tp launch --kv-bits 8 --stages 2,1` on SmolLM2 (float32): a TP group of two uneven
    ranks (5:3), then a stage of one, each quantizing its own heads of its own layers, a
    ~370-token prompt (the long ones run on the tiny model above: SmolLM2's 1k took this test
    70 s): the greedy tokens of mlx-lm's generation with kv_bits=8, group 64, from token 0."""
    from mlx_lm import load, stream_generate

    folder = default_models["smollm2-135m"]
    words = "The river carried the boat past fields, towns and old stone bridges. "
    text = words * 24 + "Summarise the story in one sentence."
    result = launch(
        tmp_path, folder, WEIGHTS, text, TOKENS, "--kv-bits", "8", "--stages", "2,1", logits=False
    )
    model, tokenizer = load(str(folder))
    model.set_dtype(mx.float32)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    assert 300 < len(ids) < 450, len(ids)
    assert result.report.prompt_tokens == len(ids)
    reference = [
        r.token
        for r in stream_generate(
            model,
            tokenizer,
            mx.array(ids),
            max_tokens=TOKENS,
            prefill_step_size=STEP,
            kv_bits=8,
            kv_group_size=64,
            quantized_kv_start=0,
        )
    ]
    assert list(result.report.tokens) == reference[: len(result.report.tokens)]
