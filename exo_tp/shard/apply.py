"""Load one rank's shard of an mlx-lm model according to a ShardPlan and the architecture table.

mlx-lm builds the model (its own classes, quantization layout and sanitize) with lazy weights;
this module then swaps in each rank's slices, read straight from the files, and evaluates layer
by layer so a rank's peak memory stays near its share.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import load_model

from exo_tp.arch import ArchTable, LinearRule, table_for
from exo_tp.plan import RankShard, ShardPlan, Span
from exo_tp.shard.layers import (
    Absent,
    RowParallel,
    VocabParallelEmbedding,
    VocabParallelHead,
    ZeroAttention,
    ZeroBranch,
)
from exo_tp.shard.safetensors_slices import Ranges, SafetensorsIndex

_QUANT_PARTS = ("weight", "scales", "biases")


def get_path(root: Any, path: str) -> Any:
    for key in path.split("."):
        root = root[int(key)] if isinstance(root, list) else getattr(root, key)
    return root


def set_path(root: Any, path: str, value: Any) -> None:
    parent, _, name = path.rpartition(".")
    setattr(get_path(root, parent) if parent else root, name, value)


class RankSelector:
    """Index ranges of one rank along each split dimension, in elements of the split axis."""

    def __init__(self, plan: ShardPlan, shard: RankShard):
        self.spec = plan.spec
        self.shard = shard

    def total(self, dim: str) -> int:
        spec = self.spec
        if dim == "q_heads":
            return spec.num_heads * spec.head_dim
        if dim == "kv_heads":
            return spec.num_kv_heads * spec.head_dim
        if dim == "vocab":
            return spec.vocab_size
        return spec.ffn_sizes[dim]

    def ranges(self, dim: str) -> list[tuple[int, int]]:
        hd = self.spec.head_dim
        if dim == "kv_heads":
            return [(k * hd, (k + 1) * hd) for k in self.shard.heads.kv_heads]
        span = self.shard.span(dim)
        if dim == "q_heads":
            return [(span.start * hd, span.stop * hd)] if span.size else []
        return [(span.start, span.stop)] if span.size else []

    def count(self, dim: str) -> int:
        if dim == "kv_heads":
            return len(self.shard.heads.kv_heads)
        return self.shard.span(dim).size

    def packed_ranges(self, parts: Sequence[str]) -> list[tuple[int, int]]:
        """Ranges along an axis packing several parts back to back (e.g. q|k|v)."""
        out, offset = [], 0
        for dim in parts:
            out += [(offset + a, offset + b) for a, b in self.ranges(dim)]
            offset += self.total(dim)
        return out


class ShardLoader:
    """Replaces a lazily loaded model's parameters by one rank's slices."""

    def __init__(self, model_dir: Path, model: nn.Module):
        self.files = SafetensorsIndex(model_dir)
        # Parameters that sanitize() leaves untouched are file tensors we may slice on disk.
        raw: dict[str, mx.array] = {}
        for path in sorted(Path(model_dir).glob("*.safetensors")):
            raw.update(mx.load(str(path)))
        sanitized = model.sanitize(dict(raw)) if hasattr(model, "sanitize") else raw
        self.direct = {k for k, v in sanitized.items() if raw.get(k) is v}

    def take(self, name: str, array: mx.array, axis: int, ranges: Ranges) -> mx.array:
        if name in self.direct and self.files.matches(name, array):
            return self.files.read(name, axis, ranges)
        parts = [mx.take(array, mx.arange(a, b), axis=axis) for a, b in ranges]
        if not parts:
            shape = list(array.shape)
            shape[axis] = 0
            return mx.zeros(shape, dtype=array.dtype)
        return mx.contiguous(mx.concatenate(parts, axis=axis))

    def slice_rows(self, name: str, module: nn.Module, ranges: Ranges) -> None:
        """Column-parallel: keep output rows (and their scales, biases, bias)."""
        for key in (*_QUANT_PARTS, "bias"):
            if key in module:
                axis = -1 if key == "bias" else -2
                module[key] = self.take(f"{name}.{key}", module[key], axis, ranges)

    def slice_columns(self, name: str, module: nn.Module, ranges: Ranges) -> None:
        """Row-parallel: keep input columns; packed quantized columns scale by bits/32."""
        quantized = "scales" in module
        for key in _QUANT_PARTS:
            if key not in module:
                continue
            if not quantized:
                scale = (1, 1)
            elif key == "weight":
                scale = (module.bits, 32)
            else:
                scale = (1, module.group_size)
            cut = [(a * scale[0] // scale[1], b * scale[0] // scale[1]) for a, b in ranges]
            module[key] = self.take(f"{name}.{key}", module[key], -1, cut)


def _shard_linear(loader: ShardLoader, layer: nn.Module, prefix: str, rule: LinearRule,
                  select: RankSelector, width: int, group: mx.distributed.Group) -> None:
    module = get_path(layer, rule.path)
    name = f"{prefix}.{rule.path}"
    ranges = select.packed_ranges(rule.parts)
    if rule.style == "column":
        loader.slice_rows(name, module, ranges)
        return
    loader.slice_columns(name, module, ranges)
    bias = module.pop("bias") if "bias" in module else None
    set_path(layer, rule.path, RowParallel(module, width, bias, group))


def _shard_block(loader: ShardLoader, layer: nn.Module, prefix: str, table: ArchTable,
                 select: RankSelector, width: int, group: mx.distributed.Group) -> None:
    empty = [b for b in table.branches if select.count(b.dim) == 0]
    for branch in empty:
        stand_in = (ZeroAttention(width, select.spec.head_dim, group) if branch.dim == "q_heads"
                    else ZeroBranch(width, group))
        set_path(layer, branch.path, stand_in)
    empty_paths = [b.path for b in empty]
    for rule in table.linears:
        if not any(rule.path.startswith(f"{path}.") for path in empty_paths):
            _shard_linear(loader, layer, prefix, rule, select, width, group)
    for count in table.counts:
        if not any(count.path.startswith(f"{path}.") for path in empty_paths):
            set_path(layer, count.path, select.count(count.dim))


def _finish(module: nn.Module, dtype: mx.Dtype | None) -> None:
    if dtype is not None:
        module.set_dtype(dtype)  # floating parameters only; packed uint32 weights stay
    mx.eval(module.parameters())


def _keep_layers(model: nn.Module, table: ArchTable, layers: Span) -> None:
    """Only this stage's blocks stay; HF-style per-layer type lists follow the slice."""
    blocks = get_path(model, table.layers)
    set_path(model, table.layers, blocks[layers.start:layers.stop])
    inner = get_path(model, table.layers.rpartition(".")[0])
    types = getattr(inner, "layer_types", None)
    if types is not None:
        inner.layer_types = types = types[layers.start:layers.stop]
        if hasattr(inner, "fa_idx"):  # mlx-lm llama: the layers whose caches make the masks
            inner.fa_idx = types.index("full_attention") if "full_attention" in types else 0
        if hasattr(inner, "swa_idx"):
            sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
            inner.swa_idx = sliding[0] if sliding else None


def _shard_vocab(model: nn.Module, loader: ShardLoader, table: ArchTable, plan: ShardPlan,
                 select: RankSelector, group: mx.distributed.Group, dtype: mx.Dtype | None,
                 first: bool, last: bool) -> None:
    """Vocab-parallel embedding (first stage; last too when tied) and LM head (last stage)."""
    tied = plan.spec.tie_word_embeddings
    sizes = [r.vocab.size for r in plan.ranks]
    vocab_rows = select.ranges("vocab")
    if first or (last and tied):
        embedding = get_path(model, table.embedding)
        loader.slice_rows(table.embedding, embedding, vocab_rows)  # (vocab, hidden): rows
        embed_dtype = dtype or (embedding.get("scales", embedding.weight)).dtype
        set_path(model, table.embedding,
                 VocabParallelEmbedding(embedding, select.shard.vocab.start, sizes,
                                        plan.spec.hidden_size, embed_dtype, group))
    else:
        set_path(model, table.embedding, Absent("the embedding"))
    if not tied:
        if last:
            head = get_path(model, table.lm_head)
            loader.slice_rows(table.lm_head, head, vocab_rows)
            set_path(model, table.lm_head, VocabParallelHead(head, sizes, group))
        else:
            set_path(model, table.lm_head, Absent("the LM head"))


def load_shard(model_dir: Path, plan: ShardPlan, rank: int, group: mx.distributed.Group,
               dtype: mx.Dtype | None = None, layers: Span | None = None,
               first: bool = True, last: bool = True) -> nn.Module:
    """The model with only rank ``rank``'s slices, ready to run inside ``group``.

    For a pipeline stage, ``layers`` limits the blocks held; ``first``/``last`` say whether the
    stage holds the embedding and the final norm + LM head.
    """
    model_dir = Path(model_dir)
    table = table_for(plan.spec.model_type)
    model, _ = load_model(model_dir, lazy=True)
    loader = ShardLoader(model_dir, model)
    select = RankSelector(plan, plan.ranks[rank])
    width = plan.spec.hidden_size
    layers = layers or Span(start=0, stop=plan.spec.num_layers)
    blocks = get_path(model, table.layers)
    for i in range(layers.start, layers.stop):
        _shard_block(loader, blocks[i], f"{table.layers}.{i}", table, select, width, group)
        _finish(blocks[i], dtype)
    _keep_layers(model, table, layers)
    if not last:
        set_path(model, table.norm, nn.Identity())
    _shard_vocab(model, loader, table, plan, select, group, dtype, first, last)
    _finish(model, dtype)
    return model
