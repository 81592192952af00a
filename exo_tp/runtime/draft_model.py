"""Drafts from a second, smaller model (`--draft-model`, mlx_lm.server's flag), for the
speculative step (exo_tp.runtime.speculative).

The draft model runs whole on the conductor's process, not sharded: it is small, and running
it on one rank keeps its drafts the same for every rank without asking every machine to
compute them bit for bit alike (Macs of different chips would not). The conductor drafts
greedily and broadcasts the drafts over the tensor-parallel group before the verify step
(one small collective); the other ranks of its stage take them from the broadcast, the ranks
of earlier pipeline stages from a `Drafts` message before the step's tokens. Greedy drafts are
points, so verifying them by sampling the target keeps the target's distribution (rejection
sampling, exo_tp.runtime.speculative).

The draft model keeps one KV cache, for the stream that speculates (only a lone stream
does). Before each draft it is brought to the stream's tokens: trimmed back to the longest
prefix it shares with them (rejected drafts, another stream), then fed the rest, at most
FEED_CHUNK tokens a step: a stream's long prompt reaches the draft over several plain steps
(no drafts yet), so no step holds every rank for a whole prompt's prefill. On a CPU a 4-bit
draft reads 128 tokens in ~21 s (docs/benchmarks.md), and a rank whose steps stop counting for
minutes is taken for stalled.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from exo_tp.runtime.batching import DivergedError
from exo_tp.runtime.follower import ControlFeed
from exo_tp.runtime.speculative import Drafter
from exo_tp.shard.collectives import broadcast_from_first
from exo_tp.transport.channel import Channel
from exo_tp.wire.runtime import Drafts

FEED_CHUNK = 128  # tokens a step the draft model reads while it catches up with a stream


class ModelDrafter:
    """The conductor's drafter: a draft model's greedy tokens, broadcast to the group and
    sent to the earlier pipeline stages (``earlier``: their ranks' control links)."""

    def __init__(
        self, model: nn.Module, group: mx.distributed.Group, earlier: Sequence[Channel[Any]] = ()
    ):
        self.model, self.group, self.earlier = model, group, list(earlier)
        self._uid: int | None = None
        self._cache: list[Any] = []
        self._fed: list[int] = []  # the tokens the cache holds

    def __call__(self, uid: int, tokens: list[int], most: int) -> list[int]:
        return share_drafts(self._draft(uid, tokens, most), most, self.group, self.earlier)

    def _draft(self, uid: int, tokens: list[int], most: int) -> list[int]:
        if uid != self._uid:
            self._uid, self._cache, self._fed = uid, make_prompt_cache(self.model), []
        shared = 0
        for held, token in zip(self._fed, tokens, strict=False):
            if held != token:
                break
            shared += 1
        shared = min(shared, len(tokens) - 1)  # feed at least the last token: its logits
        if shared < len(self._fed):
            trim_prompt_cache(self._cache, len(self._fed) - shared)
        rest = tokens[shared:]
        if len(rest) > FEED_CHUNK:  # catching up: this step reads a chunk, no drafts yet
            self.model(mx.array(rest[:FEED_CHUNK])[None], self._cache)
            mx.eval([c.state for c in self._cache])
            self._fed = tokens[: shared + FEED_CHUNK]
            return []
        logits = self.model(mx.array(rest)[None], self._cache)
        drafts: list[int] = []
        while True:
            token = cast(int, mx.argmax(logits[0, -1]).item())
            drafts.append(int(token))
            if len(drafts) == most:
                break
            logits = self.model(mx.array([[token]]), self._cache)
        self._fed = [*tokens, *drafts[:-1]]
        return drafts


def share_drafts(
    drafts: list[int], most: int, group: mx.distributed.Group, earlier: Sequence[Channel[Any]]
) -> list[int]:
    """The conductor's drafts, broadcast to its stage's ranks and sent to the earlier
    stages' (``earlier``: their control links)."""
    padded = [float(len(drafts)), *drafts, *[0.0] * (most - len(drafts))]
    agreed = _agreed(mx.array(padded, dtype=mx.float32), group)
    for channel in earlier:
        channel.send(Drafts(tokens=tuple(agreed)))
    return agreed


def conductor_drafts(most: int, group: mx.distributed.Group) -> list[int]:
    """The conductor's drafts at another rank of its stage, from its broadcast (every rank
    knows how many: the batch decides that alike everywhere)."""
    return _agreed(mx.zeros((most + 1,), dtype=mx.float32), group)


def received_drafts(group: mx.distributed.Group) -> Drafter:
    """Another rank's drafter where the conductor drafts with a model."""
    return lambda _uid, _tokens, most: conductor_drafts(most, group)


def fed_drafts(feed: ControlFeed) -> Drafter:
    """A rank of an earlier pipeline stage: the conductor's drafts, from its Drafts message."""

    def drafts(_uid: int, _tokens: list[int], most: int) -> list[int]:
        sent = list(feed.next_drafts().tokens)
        if len(sent) > most:
            raise DivergedError(f"{len(sent)} drafts for a step of at most {most}")
        return sent

    return drafts


def _agreed(mine: mx.array, group: mx.distributed.Group) -> list[int]:
    """The conductor's drafts from its broadcast: their count, then the drafts (padded to
    the step's most, the same shape on every rank)."""
    agreed = cast(list[float], broadcast_from_first(mine, group).tolist())  # a float32 row
    count, *drafts = (int(t) for t in agreed)
    return drafts[:count]
