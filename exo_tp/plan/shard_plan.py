"""The serializable result of planning: which slice of every split dimension each rank holds."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from exo_tp.arch.dims import Dim, FfnDim
from exo_tp.plan.spec import Frozen, ModelSpec


class Span(Frozen):
    """Half-open index range [start, stop)."""

    start: int = Field(ge=0)
    stop: int = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> Span:
        if self.stop < self.start:
            raise ValueError(f"span stop {self.stop} < start {self.start}")
        return self

    @property
    def size(self) -> int:
        return self.stop - self.start

    def __contains__(self, index: object) -> bool:
        return isinstance(index, int) and self.start <= index < self.stop


class HeadShard(Frozen):
    """A rank's attention heads.

    Local query head i attends with local KV slot ``i // (len(q_heads) // len(kv_heads))``;
    ``kv_heads`` lists the global KV head held in each local slot, repeated where a rank's query
    heads straddle KV groups unevenly (KV heads are then replicated, never split).
    """

    q_heads: Span
    kv_heads: tuple[int, ...]

    @property
    def repeats(self) -> int:
        return self.q_heads.size // len(self.kv_heads) if self.kv_heads else 0


class RankShard(Frozen):
    rank: int = Field(ge=0)
    weight: float = Field(ge=0)
    heads: HeadShard
    # Feed-forward rows (column-parallel outputs, row-parallel inputs) per FFN kind.
    ffn: dict[FfnDim, Span]
    vocab: Span
    # Heads of the linear-attention layers (ModelSpec.linear_attention), split on their own.
    linear_heads: Span = Span(start=0, stop=0)

    def span(self, dim: Dim) -> Span:
        """The span of a split dimension (query heads, linear-attention heads, the vocabulary,
        or an FFN kind)."""
        if dim == Dim.Q_HEADS:
            return self.heads.q_heads
        if dim == Dim.LINEAR_HEADS:
            return self.linear_heads
        if dim == Dim.VOCAB:
            return self.vocab
        return self.ffn[dim]


class Collective(Frozen):
    """One communication step per use, with the common shape every rank sends."""

    name: str
    op: Literal["all_sum", "all_gather"]
    # Per-rank payload length along the split axis, and the padded length actually sent.
    sizes: tuple[int, ...]
    padded: int
    per_layer: int = 0  # how many times per transformer layer (0: once per forward)


class ShardPlan(Frozen):
    spec: ModelSpec
    weights: tuple[float, ...]
    attention_unit: Literal["kv_group", "q_head"]
    head_unit: int  # query heads per attention unit
    linear_head_unit: int = 1  # linear-attention heads per unit
    ffn_unit: int  # rows per FFN unit
    vocab_unit: int
    ranks: tuple[RankShard, ...]
    collectives: tuple[Collective, ...]

    @property
    def size(self) -> int:
        return len(self.ranks)

    def collective(self, name: str) -> Collective:
        return next(c for c in self.collectives if c.name == name)
