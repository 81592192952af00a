"""n choices of one prompt share its prefill: the first choice's prompt KV cache goes to the
prompt cache at its first token (Insert.keep_prompt), and a choice joining then is served
from it, its greedy tokens still single-device mlx-lm's. In process: one rank's batch (the
API's n is tested on a cluster in test_structured.py)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from helpers import greedy_batch, mlx_lm_reference
from mlx_lm import load

from exo_tp.wire.runtime import Insert

PROMPT = "What is the capital of France?"
TOKENS = 8


def test_a_kept_prompt_serves_the_next_choice_from_the_prompt_cache(
    default_models: dict[str, Path],
) -> None:
    model_dir = default_models["smollm2-135m"]
    model, tokenizer = load(str(model_dir))
    model.set_dtype(mx.float32)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
    )
    prompt = tuple(tokenizer.encode(text, add_special_tokens=False))
    batch = greedy_batch(model, tokenizer, prompt_cache_size=4)
    generated: dict[int, list[int]] = {0: [], 1: []}
    assert batch.insert(Insert(uid=0, tokens=prompt, max_tokens=TOKENS, keep_prompt=True))[0] == 0
    while not generated[0]:
        for response in batch.step():
            generated[response.uid].append(response.token)
    cached = batch.insert(Insert(uid=1, tokens=prompt, max_tokens=TOKENS)).cached
    assert cached == len(prompt) - 1  # all but the last token, which must run again
    while not batch.idle:
        for response in batch.step():
            generated[response.uid].append(response.token)
    batch.close()
    reference = mlx_lm_reference(model_dir, PROMPT, TOKENS).tokens
    assert generated == {0: reference, 1: reference}
