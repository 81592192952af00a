"""Drafting with the MTP heads on every rank of the last stage.

Every rank of the last stage holds the model's whole hidden state after its last layer (the
last all-reduce), so each runs the heads itself: no collective for the hidden state. The heads
read the next token's embedding and write logits through the stage's own vocab-parallel
embedding and LM head (one all-reduce and one gather per draft token), which is why every
rank of the stage runs them in step, the same calls with the same shapes. Ranks of different
chips may still round differently, so the conductor's drafts are the ones used: broadcast to
its stage, sent to the earlier stages (exo_tp.runtime.draft_model.share_drafts).

The heads keep their own KV cache for the stream that speculates (only a lone stream does):
one entry per position p of the stream, fed with the target's hidden state at p and the
token at p + 1, as mlx-vlm's drafters feed it (``prefill_from_target_hidden``). At each
draft the positions run since the last one (its prompt's chunks, plain steps, the kept part
of the last verify step, recorded by `HiddenTap`) are fed in one call; the first draft is
read from the last of them, each further draft from the heads' own output state and the
draft before it (the family's MTP chain); those chained entries are trimmed away again at
the next draft, where the target's own states for the kept positions replace them.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from exo_tp.runtime.draft_model import conductor_drafts, share_drafts
from exo_tp.runtime.mtp.tap import HiddenTap
from exo_tp.transport.channel import Channel


class MtpDrafter:
    """A Drafter (exo_tp.runtime.speculative) for every rank of the last stage; ``earlier``:
    the earlier stages' control links (the conductor's only)."""

    def __init__(
        self,
        heads: nn.Module,
        hidden: HiddenTap,
        embed: nn.Module,
        lm_head: Any,
        group: mx.distributed.Group,
        conductor: bool,
        earlier: Sequence[Channel[Any]] = (),
    ):
        # mlx-vlm's drafters bind ``embed_tokens`` and ``lm_head`` from a target model
        # (Qwen's at its top, GLM's under ``.model``): the stage's own, vocab-parallel
        target = SimpleNamespace(embed_tokens=embed, lm_head=lm_head)
        target.model = target
        self.heads = heads.bind(target)
        self.hidden = hidden
        self.group, self.conductor, self.earlier = group, conductor, list(earlier)
        self._uid: int | None = None
        self._fed = 0  # positions whose (state, next token) the heads' cache holds
        self._chained = 0  # entries of the last draft's chain, trimmed at the next

    def __call__(self, uid: int, tokens: list[int], most: int) -> list[int]:
        drafts = self._draft(uid, tokens, most)
        if self.conductor:
            return share_drafts(drafts, most, self.group, self.earlier)
        return conductor_drafts(most, self.group)

    def _draft(self, uid: int, tokens: list[int], most: int) -> list[int]:
        heads = self.heads
        if uid != self._uid:
            self._uid, self._fed, self._chained = uid, 0, 0
            heads._cache = heads.make_cache()
        if self._chained:
            for cache in heads._cache:
                cache.trim(self._chained)
            self._chained = 0
        ran = len(tokens) - 1  # positions the target has run (the last token is pending)
        states = self.hidden.take()
        held = 0 if states is None else min(states.shape[0], ran)
        first = max(ran - held, self._fed)
        if states is None or first >= ran:
            return []  # no state for the last position yet (others were in the batch)
        hidden = states[states.shape[0] - (ran - first) :][None]
        h = self._forward(tokens[first + 1 : ran + 1], hidden, first)[:, -1:]
        self._fed = ran
        drafts: list[int] = []
        while True:
            drafts.append(cast(int, mx.argmax(heads._lm_head_fn(h)[0, -1]).item()))
            if len(drafts) == most:
                return drafts
            h = self._forward(drafts[-1:], h, ran + len(drafts) - 1)
            self._chained += 1

    def _forward(self, ids: list[int], hidden: mx.array, position: int) -> mx.array:
        """The heads over (token at p + 1, state at p) pairs from ``position`` on."""
        if hasattr(self.heads, "_next_position"):  # Qwen's heads rope by their own count
            self.heads._next_position = position
        return self.heads._forward_tokens(mx.array([ids], dtype=mx.int32), hidden, mx.int32)
