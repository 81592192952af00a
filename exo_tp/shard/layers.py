"""MLX modules that wrap mlx-lm's own layers for uneven tensor parallelism.

Split linears need no wrapper: they are mlx-lm's own (quantized, stacked) layers holding a rank's
slices. A sub-block whose output is a partial sum is wrapped once (one all-reduce); a sub-block
of which a rank holds nothing is replaced by zeros. Vocab-parallel embedding and LM head hold a
rank's vocabulary rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn

from exo_tp.arch.dims import Dim
from exo_tp.shard.collectives import gather_padded, sum_over_ranks, zeros_after
from exo_tp.shard.sharded_norm import join_norm_sum

HeadMode = Literal["gathered", "local", "hidden"]


class Wrapper(nn.Module):
    """A module around another (``inner``) whose attributes stay readable through it: model
    code may read attributes of the sub-block it called (a head count, a weight's dtype)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def __getattr__(self, key: str) -> Any:
        try:
            return super().__getattr__(key)
        except AttributeError:
            if "inner" not in self:  # still being built
                raise
            return getattr(self["inner"], key)


class PartialSum(Wrapper):
    """A sub-block (attention, MLP, MoE block) whose output on each rank is a partial sum of
    the full output: one all-reduce completes it.

    Row-parallel weights inside it are sliced, not wrapped, so a MoE block's weighted sum over
    experts (plus its shared experts) is reduced once, not once per expert or per linear.
    """

    def __init__(self, inner: nn.Module, width: int, group: mx.distributed.Group):
        super().__init__(inner)
        self._width = width
        self._group = group

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.partial(*args, **kwargs)
        if isinstance(out, tuple):  # (output, what the layer hands on: KV, offset): output only
            return (self.reduce(out[0]), *out[1:])
        return self.reduce(out)

    def partial(self, *args: Any, **kwargs: Any) -> Any:
        """This rank's partial sum, not yet reduced (a fused step joins two before one
        reduce: exo_tp.shard.fused_step)."""
        return self.inner(*args, **kwargs)

    def reduce(self, partial: mx.array) -> mx.array:
        """The whole output from this rank's partial sum (every rank's, all-reduced)."""
        return sum_over_ranks(partial, self._width, self._group)


class GroupedScoresMask(Wrapper):
    """Gives a batched attention mask the KV-group axis that an attention computing its scores
    as (B, KV heads, repeats, L, S) needs: (B, 1, L, S) becomes (B, 1, 1, L, S). A causal
    string, no mask, or an attention without grouped queries pass unchanged."""

    def __call__(self, x: mx.array, mask: Any = None, *args: Any, **kwargs: Any) -> mx.array:
        grouped = getattr(self.inner, "repeats", 1) > 1
        if grouped and isinstance(mask, mx.array) and mask.ndim == 4:
            mask = mx.expand_dims(mask, 2)
        return self.inner(x, mask, *args, **kwargs)


class SumFirst(Wrapper):
    """A replicated module acting on the whole sum of the partial values it is given
    (ArchTable.sums): its input is all-reduced first."""

    def __init__(self, inner: nn.Module, width: int, group: mx.distributed.Group):
        super().__init__(inner)
        self._width = width
        self._group = group

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> Any:
        return self.inner(sum_over_ranks(x, self._width, self._group), *args, **kwargs)


class KeptByOne(Wrapper):
    """A replicated module whose output is whole on every rank inside a sub-block that is
    all-reduced (after a SumFirst): one rank keeps it, the others give zeros, so the
    all-reduce adds it once."""

    def __init__(self, inner: nn.Module, width: int, keep: bool):
        super().__init__(inner)
        self._width = width
        self._keep = keep

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> Any:
        if self._keep:
            return self.inner(x, *args, **kwargs)
        return zeros_after((*x.shape[:-1], self._width), x.dtype, x)


class GroupedHeads(Wrapper):
    """The inner stack of a grouped low-rank output (exo_tp.arch.GroupedOutputRule) on a rank
    holding the entries of ``groups`` consecutive groups of ``per_group`` heads of width
    ``head_dim``, its own heads starting at place ``start`` of the first: the attention hands it
    the rank's heads' outputs as one piece; the heads of those groups held elsewhere enter as
    zeros, so each group's result is this rank's part of it."""

    def __init__(self, inner: nn.Module, start: int, per_group: int, groups: int, head_dim: int):
        super().__init__(inner)
        self._start, self._per_group, self._groups = start, per_group, groups
        self._head_dim = head_dim
        self._ids = mx.arange(groups)[None]

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        rows = x.shape[0]  # (batch x length, 1, 1, local heads x head_dim)
        heads = x.reshape(rows, -1, self._head_dim)
        after = self._groups * self._per_group - self._start - heads.shape[1]
        if self._start or after:
            heads = mx.pad(heads, [(0, 0), (self._start, after), (0, 0)])
        grouped = heads.reshape(rows, self._groups, 1, self._per_group * self._head_dim)
        return self.inner(grouped, self._ids)


class ZeroMLP(nn.Module):
    """Stands in for a sub-block called with ``x`` of which this rank holds nothing: zeros of
    the output's shape, tied to ``x`` (see ``zeros_after``) so collectives keep their order.

    ``sums``: the widths of the all-reduces inside the sub-block (SumFirst), which this rank
    joins with zeros before its output, as its peers run them before theirs."""

    def __init__(
        self,
        width: int,
        sums: tuple[int, ...] = (),
        group: mx.distributed.Group | None = None,
    ):
        super().__init__()
        self._width = width
        self._sums = sums
        self._sum_group = group

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        out = zeros_after((*x.shape[:-1], self._width), x.dtype, x)
        if not self._sums or self._sum_group is None:
            return out
        lead = x.shape[:-1]
        joined = [
            sum_over_ranks(zeros_after((*lead, w), x.dtype, x), w, self._sum_group)
            for w in self._sums
        ]
        return mx.depends(out, joined)


class ZeroExperts(ZeroMLP):
    """Stands in for stacked experts (SwitchGLU) of which this rank holds no rows: one zero
    output per routed expert, as ``switch_mlp(x, indices)`` returns."""

    def __call__(self, x: mx.array, indices: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        return zeros_after((*indices.shape, self._width), x.dtype, x)


class ZeroAttention(ZeroMLP):
    """Stands in for attention on a rank that holds no heads.

    mlx-lm's prefill evaluates only the KV caches, so every rank's caches must depend on the
    layer inputs exactly as a real attention's do: otherwise this rank would skip the prefill
    all-reduces its peers run, and the ring would hang. It therefore caches one head-sized
    slice of its input (a stand-in head: negligible memory, never read). The cache keeps its
    offset (and a rotating cache its window) in step with the peers', which masks rely on.

    ``joins``: the full-width norms inside the attention (NormRule dims), whose all-reduces
    this rank joins with zeros: a key norm's before its cache update (peers cache normalised
    keys: their prefill runs that all-reduce), every one before its output.
    """

    def __init__(
        self,
        width: int,
        head_dim: int,
        joins: tuple[Dim, ...] = (),
        group: mx.distributed.Group | None = None,
    ):
        super().__init__(width)
        self._head_dim = head_dim
        self._joins = joins
        self._group = group

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        cache = _cache_argument(args, kwargs)
        sums = [join_norm_sum(x, self._group) for _ in self._joins] if self._group else []
        if cache is not None:
            keyed = [s for s, dim in zip(sums, self._joins, strict=True) if dim == Dim.KV_HEADS]
            self._cache_stand_in(x, cache, keyed)
        out = super().__call__(x)
        return mx.depends(out, sums) if sums else out

    def _cache_stand_in(
        self, x: mx.array, cache: Any, after: Sequence[mx.array] = ()
    ) -> tuple[mx.array, mx.array]:
        """A stand-in head's keys and values (one head-sized slice of ``x``), through the cache
        when there is one; computed after ``after``."""
        b, length, _ = x.shape
        rows = x[..., : self._head_dim]
        if after:
            rows = mx.depends(rows, list(after))
        if hasattr(cache, "update_window"):
            # DeepSeek V4.1's LayerCache: one latent row per token in a sliding window (its
            # offset gives the layer its positions); the compressed parts are never read here.
            window = cache.update_window(rows)
            return window, window
        stand_in = rows.reshape(b, length, 1, -1).transpose(0, 2, 1, 3)
        if cache is None:
            return stand_in, stand_in
        # A CacheList (DeepSeek Sparse Attention: latent cache + indexer key cache) keeps every
        # one of its caches in step.
        caches = getattr(cache, "caches", (cache,))
        return [one.update_and_fetch(stand_in, stand_in) for one in caches][0]


class ZeroRecurrent(ZeroMLP):
    """Stands in for a recurrent linear-attention layer (Kimi Delta Attention) on a rank that
    holds none of its heads.

    Its cache (mlx-lm's ArraysCache: a conv state and a recurrent state per stream) is kept in
    step with the peers': every slot holds a one-element stand-in per stream computed from the
    layer's input (the prefill evaluates only the caches, so they must depend on the input as
    the real layer's do, see ZeroAttention; and the batch's merges, filters and extractions
    need every slot filled), and its padding and lengths advance as the real layer's do."""

    def __call__(  # type: ignore[override]
        self, x: mx.array, mask: Any = None, cache: Any = None, *args: Any, **kwargs: Any
    ) -> mx.array:
        if cache is not None:
            stand_in = x[:, -1:, :1]
            for slot in range(len(cache.cache)):
                cache[slot] = stand_in
            cache.advance(x.shape[1])
        return super().__call__(x)


def _cache_argument(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """The KV cache an attention was called with: by keyword, or positionally after the mask
    (or, as Mistral 4 and Ministral 3 pass it, after the mask and a query scale). It is the one
    argument that is a cache (one with update_and_fetch, or a CacheList of them)."""
    if "cache" in kwargs:
        return kwargs["cache"]
    return next((a for a in args if hasattr(a, "update_and_fetch") or hasattr(a, "caches")), None)


class ZeroSharingAttention(ZeroAttention):
    """Stands in for an attention that hands its keys and values on to later layers (Gemma 4,
    see BranchRule.shares_kv): returns (zeros, (keys, values), offset) as the real one does.
    A layer with its own KV caches a stand-in head (see ZeroAttention); a KV-shared layer hands
    on what it was given."""

    def __call__(  # type: ignore[override]
        self,
        x: mx.array,
        mask: Any = None,
        cache: Any = None,
        shared_kv: Any = None,
        offset: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[mx.array, Any, Any]:
        out = ZeroMLP.__call__(self, x)
        if shared_kv is not None:
            return out, shared_kv, offset
        offset = mx.array(cache.offset) if cache is not None else 0
        return out, self._cache_stand_in(x, cache), offset


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [start, stop) of the vocabulary; lookups are summed over ranks.

    Also serves as the tied LM head through ``as_linear``: local logits for its rows, gathered
    (padded to equal shapes) into the full vocabulary.
    """

    def __init__(
        self,
        inner: nn.Module,
        start: int,
        sizes: Sequence[int],
        width: int,
        dtype: mx.Dtype,
        group: mx.distributed.Group,
    ):
        super().__init__()
        self.inner = inner
        self._start = start
        self._dtype = dtype
        self._sizes = tuple(sizes)
        self._width = width
        self._group = group
        # as_linear's output (exo_tp.runtime.prompt_scores): "gathered" logits, this rank's
        # "local" rows only, or the "hidden" state itself (embeddings)
        self.head_mode: HeadMode = "gathered"

    @property
    def _local_size(self) -> int:
        return self._sizes[self._group.rank()]

    def __call__(self, ids: mx.array) -> mx.array:
        return self.reduce(self.local(ids))

    def local(self, ids: mx.array) -> mx.array:
        """This rank's term of the lookup: its rows, zeros for ids it does not hold."""
        local = ids - self._start
        inside = (local >= 0) & (local < self._local_size)
        if self._local_size:
            rows = self.inner(mx.where(inside, local, 0))
            return rows * inside[..., None].astype(rows.dtype)
        return zeros_after((*ids.shape, self._width), self._dtype, ids)

    def reduce(self, rows: mx.array) -> mx.array:
        """The ranks' terms summed: the lookup."""
        return sum_over_ranks(rows, self._width, self._group)

    @property
    def vocab_start(self) -> int:
        return self._start

    @property
    def group(self) -> mx.distributed.Group:
        return self._group

    def as_linear(self, x: mx.array) -> mx.array:
        if self.head_mode == "hidden":
            return x
        local = self.inner.as_linear(x) if self._local_size else _no_logits(x)
        if self.head_mode == "local":
            return local
        return gather_padded(local, self._sizes, self._group)


class VocabParallelHead(nn.Module):
    """An untied LM head holding rows [start, stop) of the vocabulary."""

    def __init__(self, inner: nn.Module, sizes: Sequence[int], group: mx.distributed.Group):
        super().__init__()
        self.inner = inner
        self._sizes = tuple(sizes)
        self._group = group
        self.head_mode: HeadMode = "gathered"  # as VocabParallelEmbedding.as_linear's

    @property
    def vocab_start(self) -> int:
        return sum(self._sizes[: self._group.rank()])

    @property
    def group(self) -> mx.distributed.Group:
        return self._group

    def __call__(self, x: mx.array) -> mx.array:
        if self.head_mode == "hidden":
            return x
        local = self.inner(x) if self._sizes[self._group.rank()] else _no_logits(x)
        if self.head_mode == "local":
            return local
        return gather_padded(local, self._sizes, self._group)


class TiedHead(nn.Module):
    """The LM head of a model that ties it to the embedding by reading the embedding's weight
    (ArchTable.untie_attr): the vocab-parallel embedding's gathered logits."""

    def __init__(self, embedding: VocabParallelEmbedding):
        super().__init__()
        self.embedding = embedding

    def __call__(self, x: mx.array) -> mx.array:
        return self.embedding.as_linear(x)


class Absent(nn.Module):
    """A part of the model this pipeline stage does not hold (never called, never loaded)."""

    def __init__(self, what: str):
        super().__init__()
        self._what = what

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        raise RuntimeError(f"{self._what} is held by another pipeline stage")

    def as_linear(self, x: mx.array) -> mx.array:
        return self(x)


def _no_logits(x: mx.array) -> mx.array:
    return zeros_after((*x.shape[:-1], 0), x.dtype, x)


class _Slot:
    """Holds the next hidden state outside the module tree (an array attribute of a Module
    would become one of its parameters)."""

    def __init__(self) -> None:
        self.value: mx.array | None = None


class HiddenFeed(nn.Module):
    """The embedding of a pipeline stage after the first: the model's own forward pass looks
    its inputs up here and gets the previous stage's hidden state instead, so any family whose
    model embeds its tokens and then runs its layers pipelines without an ``input_embeddings``
    argument. A tied LM head on the last stage still multiplies by the held embedding rows."""

    def __init__(self, embedding: nn.Module):
        super().__init__()
        self.embedding = embedding
        self._next = _Slot()

    def feed(self, hidden: mx.array) -> None:
        self._next.value = hidden

    def __call__(self, inputs: mx.array) -> mx.array:
        hidden, self._next.value = self._next.value, None
        if hidden is None:
            raise RuntimeError("no hidden state from the previous pipeline stage")
        return hidden

    def as_linear(self, x: mx.array) -> mx.array:
        return self.embedding.as_linear(x)
