"""The prompt cache with recurrent state (mlx-lm's ArraysCache: the linear attention of Kimi K3,
Qwen 3.5 and Qwen3-Next)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from exo_tp.runtime.prompt_cache import PromptCache


def _entry(tokens: int) -> list[object]:
    """One attention layer's KV cache and one recurrent layer's state after ``tokens``."""
    kv, state = KVCache(), ArraysCache(size=2)
    kv.update_and_fetch(mx.zeros((1, 1, tokens, 4)), mx.zeros((1, 1, tokens, 4)))
    state[0], state[1] = mx.full((1, 3, 4), float(tokens)), mx.full((1, 2, 4, 4), float(tokens))
    return [kv, state]


def test_a_recurrent_state_is_reused_only_for_prompts_that_extend_its_tokens() -> None:
    """A state cannot be trimmed back: a prompt sharing only part of an entry, or equal to it
    (its last token must run again), starts afresh; a longer one resumes from the state."""
    cache = PromptCache(max_entries=4, max_bytes=None, bytes_per_token=8)
    cache.insert([1, 2, 3, 4], _entry(4))
    assert cache.fetch([1, 2, 3, 4]) == (None, 0)  # the same prompt
    assert cache.fetch([1, 2, 9]) == (None, 0)  # a shorter shared prefix
    assert cache.fetch([1, 2, 3]) == (None, 0)  # a prefix of the entry
    found, cached = cache.fetch([1, 2, 3, 4, 5, 6])
    assert cached == 4 and found is not None
    assert found[0].offset == 4 and found[1][1].max().item() == 4.0
    cache.insert([1, 2], _entry(2))  # a shorter entry stays: the longer one cannot serve it
    assert len(cache) == 2
    assert cache.fetch([1, 2, 7])[1] == 2


def test_every_entry_counts_its_recurrent_state_in_the_budget() -> None:
    cache = PromptCache(max_entries=8, max_bytes=900, bytes_per_token=10, bytes_per_entry=300)
    cache.insert([1, 2, 3], _entry(3))
    cache.insert([5, 6], _entry(2))
    assert cache.nbytes == 5 * 10 + 2 * 300
    cache.insert([7, 8, 9, 10], _entry(4))  # 90 + 900 bytes: the oldest entry goes
    assert len(cache) == 2 and cache.nbytes == 6 * 10 + 2 * 300
