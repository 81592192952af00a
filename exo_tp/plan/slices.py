"""Which index ranges of each split dimension one rank holds, in elements of a weight's axis
(pure: the loader slices by these, the planner's tests check them)."""

from __future__ import annotations

import copy
from collections.abc import Sequence

from exo_tp.arch import LinearRule
from exo_tp.arch.dims import HEAD_DIMS, Dim
from exo_tp.plan.shard_plan import RankShard, ShardPlan, Span
from exo_tp.plan.tensor_parallel import layer_view

Ranges = list[tuple[int, int]]


class RankSelector:
    def __init__(self, plan: ShardPlan, rank: int):
        self.spec = plan.spec
        self.shard: RankShard = plan.ranks[rank]

    def layer(self, index: int) -> RankSelector:
        """This rank's selector for layer ``index`` (its variant's sizes; itself if plain)."""
        spec, shard = layer_view(self.spec, self.shard, index)
        if spec is self.spec:
            return self
        view = copy.copy(self)
        view.__dict__ = {"spec": spec, "shard": shard}  # no cached rule ranges of another view
        return view

    def count(self, dim: Dim) -> int:
        """Local size of a dimension: heads, KV slots, query heads per KV slot, or rows."""
        if dim == Dim.KV_HEADS:
            return len(self.shard.heads.kv_heads)
        if dim == Dim.REPEATS:
            return self.shard.heads.repeats
        return self.shard.span(dim).size

    def _total(self, dim: Dim, per_head: int) -> int:
        spec = self.spec
        if dim == Dim.Q_HEADS:
            return spec.num_heads * per_head
        if dim == Dim.KV_HEADS:
            return spec.num_kv_heads * per_head
        if dim == Dim.LINEAR_HEADS and spec.linear_attention is not None:
            return spec.linear_attention.num_heads * per_head
        if dim == Dim.VOCAB:
            return spec.vocab_size
        return spec.ffn_sizes[dim]

    def ranges(self, dim: Dim, per_head: int = 1) -> Ranges:
        """This rank's ranges of ``dim``; a head is ``per_head`` elements wide."""
        if dim == Dim.KV_HEADS:  # one range per local slot: replicated KV heads repeat
            return [(k * per_head, (k + 1) * per_head) for k in self.shard.heads.kv_heads]
        span = self.shard.span(dim)
        scale = per_head if dim in HEAD_DIMS else 1
        return [(span.start * scale, span.stop * scale)] if span.size else []

    def packed(self, parts: Sequence[Dim], per_head: int | Sequence[int]) -> tuple[Ranges, int]:
        """Ranges along an axis packing several parts back to back (e.g. q|k|v), and the
        axis length the plan expects; ``per_head``: one width for all parts, or one each."""
        widths = [per_head] * len(parts) if isinstance(per_head, int) else list(per_head)
        out: Ranges = []
        offset = 0
        for dim, width in zip(parts, widths, strict=True):
            out += [(offset + a, offset + b) for a, b in self.ranges(dim, width)]
            offset += self._total(dim, width)
        return out, offset

    def rule(self, rule: LinearRule) -> tuple[Ranges, int]:
        """This rank's ranges along the split axis of ``rule``, and that axis' full length."""
        return self.packed(rule.parts, rule.part_widths(self.spec.head_width))

    def touched_groups(self, groups: int) -> Span:
        """The output groups (of ``num_heads / groups`` consecutive query heads each) that this
        rank's heads lie in (exo_tp.arch.GroupedOutputRule); empty without heads."""
        heads, per_group = self.shard.heads.q_heads, self.spec.num_heads // groups
        if not heads.size:
            return Span(start=0, stop=0)
        return Span(start=heads.start // per_group, stop=(heads.stop - 1) // per_group + 1)

    def holds(self, rule: LinearRule) -> bool:
        return bool(self.rule(rule)[0])
