"""Each rank's shard of recent requests' KV caches, keyed by token prefix (LRU).

Every rank of an epoch keeps its own entries (its KV heads and layers) and must make exactly the
same decisions as the others, so that a hit on the conductor is a hit everywhere: entries are
inserted and looked up at the same batch steps on every rank, and sizes are not measured from
the local arrays (uneven shards hold different bytes) but counted in tokens times the plan's KV
bytes per token on the rank that holds the most, plus, for recurrent layers (the linear attention
of Kimi K3, Qwen 3.5 and Qwen3-Next), the state every entry holds whatever its length. mlx-lm's
`PromptTrie` finds the nearest entry; `LRUPromptCache` is not used as is because it evicts by
each process's own bytes.

A recurrent state (mlx-lm's ArraysCache) cannot be trimmed: it is the state after exactly the
entry's tokens. So an entry is only ever reused for a prompt that extends it; one that covers
tokens the prompt lacks is not served (the prompt starts afresh) rather than reused with a state
advanced past the shared prefix (`can_trim_prompt_cache` is false for such an entry).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import PromptTrie, can_trim_prompt_cache, trim_prompt_cache

from exo_tp.wire.assignment import ServingOptions

_MODEL = "model"  # one model per epoch: the trie's model key


class PromptCache:
    def __init__(
        self,
        max_entries: int,
        max_bytes: int | None,
        bytes_per_token: int,
        bytes_per_entry: int = 0,
    ):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.bytes_per_token, self.bytes_per_entry = bytes_per_token, bytes_per_entry
        self._trie = PromptTrie()
        self._order: OrderedDict[tuple[int, ...], None] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._order)

    @property
    def nbytes(self) -> int:
        """Bytes of the largest shard of every entry (the budget's measure)."""
        tokens = sum(len(key) for key in self._order)
        return tokens * self.bytes_per_token + len(self._order) * self.bytes_per_entry

    def fetch(self, tokens: list[int]) -> tuple[list[Any] | None, int]:
        """A copy of the nearest cache for ``tokens`` and how many leading tokens it covers
        (at most ``len(tokens) - 1``: the last prompt token must still run through the model)."""
        if not self._order:
            return None, 0
        found = self._trie.search(_MODEL, tokens)
        shorter = len(found.shorter) if found.shorter is not None else 0
        key, cached = None, 0
        if found.exact is not None:
            key, cached = found.exact, len(tokens)
        elif found.longer is not None and found.common_prefix > shorter:
            key, cached = found.longer, found.common_prefix
        elif shorter:
            key, cached = found.shorter, shorter
        if key is None:
            return None, 0
        entry = self._trie.get(_MODEL, key)
        cached = min(cached, len(tokens) - 1)
        if len(key) > cached and not can_trim_prompt_cache(entry):
            return None, 0  # it covers tokens the prompt does not have, and cannot drop them
        cache = copy.deepcopy(entry)
        if len(key) > cached:
            trim_prompt_cache(cache, len(key) - cached)
        self._order.move_to_end(tuple(key))
        return cache, cached

    def insert(self, tokens: list[int], cache: list[Any]) -> None:
        key = tuple(tokens)
        if not key:
            return
        self._trie.add(_MODEL, list(key), cache)
        self._order[key] = None
        self._order.move_to_end(key)
        if can_trim_prompt_cache(cache):  # a longer trimmable entry serves its prefixes too
            for length, _ in self._trie.pop_prefixes(_MODEL, list(key)):
                self._order.pop(key[:length], None)
        self.trim()

    def trim(self) -> None:
        while len(self._order) > self.max_entries or (
            self.max_bytes is not None and self._order and self.nbytes > self.max_bytes
        ):
            oldest, _ = self._order.popitem(last=False)
            self._trie.pop(_MODEL, list(oldest))


def prompt_cache_for(
    options: ServingOptions, bytes_per_token: int, bytes_per_entry: int
) -> PromptCache | None:
    """The serving options' prompt cache (None where they keep none)."""
    if options.prompt_cache_size <= 0:
        return None
    return PromptCache(
        options.prompt_cache_size, options.prompt_cache_bytes, bytes_per_token, bytes_per_entry
    )


def prompt_alone(batch: GenerationBatch, uid: int, prompt: list[int]) -> list[Any] | None:
    """A copy of a decoding stream's cache holding its prompt alone (the token computed past
    it trimmed), or None where that cannot be had: the stream finished at once (it was kept
    whole as it left), or its cache cannot be trimmed."""
    if uid not in batch.uids:
        return None
    row = batch.uids.index(uid)
    cache, extra = batch.extract_cache(row), len(batch.tokens[row]) - len(prompt)
    if extra > 0 and not can_trim_prompt_cache(cache):
        return None
    if extra > 0:
        trim_prompt_cache(cache, extra)
    return cache
