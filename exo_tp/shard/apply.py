"""Load one rank's shard of an mlx-lm model according to a ShardPlan and the architecture table.

mlx-lm builds the model (its own classes, quantization layout and sanitize) with lazy weights;
each block is then sharded by its table (exo_tp.shard.blocks), each slice read straight from the
files, and evaluated block by block so a rank's peak memory stays near its share. Embedding and
LM head are vocab-parallel.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from exo_tp.arch import ArchTable, Dim, table_for
from exo_tp.plan import ShardPlan, Span
from exo_tp.plan.slices import RankSelector
from exo_tp.shard.adapters import apply_to_block, check_layers, read_adapter
from exo_tp.shard.blocks import BlockSharder
from exo_tp.shard.layers import (
    Absent,
    HiddenFeed,
    TiedHead,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from exo_tp.shard.sequences import batch_by_sequence
from exo_tp.shard.slicing import WeightSlicer, load_lazily
from exo_tp.shard.streams import link_stages
from exo_tp.shard.tree import get_path, has_path, set_path


def _finish(
    module: nn.Module, dtype: mx.Dtype | None, keep: Callable[[str], bool] = lambda _: True
) -> None:
    """Cast floating parameters to ``dtype`` (packed uint32 weights stay) where ``keep`` (the
    model's cast_predicate, as mlx-lm's converter applies it) allows: sigmoid routers' score
    correction biases stay float32, so routing does not change with the compute dtype."""
    if dtype is not None:

        def cast(path: str, value: mx.array) -> mx.array:
            floating = mx.issubdtype(value.dtype, mx.floating)
            return value.astype(dtype) if floating and keep(path) else value

        module.update(tree_map_with_path(cast, module.parameters()))
    mx.eval(module.parameters())


def _kept_under(keep: Callable[[str], bool], prefix: str) -> Callable[[str], bool]:
    """``keep`` for the paths inside the module at ``prefix``."""
    return lambda path: keep(f"{prefix}.{path}")


# The model attributes naming the first layer of each kind, whose cache makes that kind's mask
# (llama's fa_idx/swa_idx, gpt-oss' and EXAONE MoE's ga_idx/swa_idx, EXAONE 4's full_idx,
# Step 3.5's _full_idx/_swa_idx).
_FIRST_FULL: tuple[str, ...] = ("fa_idx", "ga_idx", "full_idx", "_full_idx")
_FIRST_SLIDING: tuple[str, ...] = ("swa_idx", "_swa_idx")
# Hybrids of linear and full attention (Qwen 3.5, Qwen3-Next): the first linear layer's
# ArraysCache makes the recurrent layers' mask; their blocks say which kind they are.
_FIRST_LINEAR: tuple[str, ...] = ("ssm_idx",)


def _is_sliding(block: nn.Module) -> bool | None:
    """A block's own sliding-window flag, where its family keeps one (on the block, or as
    EXAONE 4 does, on its attention)."""
    for name in ("is_sliding_window", "is_sliding"):
        if hasattr(block, name):
            return bool(getattr(block, name))
    attention = getattr(block, "self_attn", None)
    if attention is not None and hasattr(attention, "is_local"):
        return bool(attention.is_local)
    return None


def _keep_layers(model: nn.Module, table: ArchTable, layers: Span) -> None:
    """Only this stage's blocks stay; per-layer type lists follow the slice, and so do the
    indices of the first full and first sliding layer, whose caches make the masks (from the
    layer types, or from each block's sliding flag)."""
    blocks = get_path(model, table.layers)
    kept = blocks[layers.start : layers.stop]
    set_path(model, table.layers, kept)
    inner = get_path(model, table.stack)
    if kept and all(hasattr(block, "block_type") for block in kept):
        _first_cached(inner, [block.block_type for block in kept])
        return
    if kept and all(hasattr(block, "is_attention_layer") for block in kept):  # LFM2
        kinds = ["*" if block.is_attention_layer else "M" for block in kept]
        _first_cached(inner, kinds, (("fa_idx", "*"), ("conv_idx", "M")))
        return
    if kept and all(hasattr(block, "is_linear") for block in kept):
        # the model makes no mask for a kind it has no index of (mlx-lm's own pipeline)
        for names, kind in ((_FIRST_FULL, False), (_FIRST_LINEAR, True)):
            first = next((i for i, b in enumerate(kept) if bool(b.is_linear) == kind), None)
            for name in names:
                if hasattr(inner, name):
                    setattr(inner, name, first)
        return
    types = getattr(inner, "layer_types", None)
    if types is not None:
        inner.layer_types = types = types[layers.start : layers.stop]
        sliding = [t == "sliding_attention" for t in types]
    else:
        flags = [_is_sliding(block) for block in kept]
        if any(flag is None for flag in flags):
            return
        sliding = [bool(flag) for flag in flags]
    for names, kind in ((_FIRST_FULL, False), (_FIRST_SLIDING, True)):
        first = next((i for i, s in enumerate(sliding) if s == kind), None)
        for name in names:
            if hasattr(inner, name):
                # None means "no such layer" to the model; where it held an index, a stage
                # without that kind makes a mask it never uses
                had = getattr(inner, name) is not None
                setattr(inner, name, first if first is not None else (0 if had else None))


class _OneMoreCache:
    """A layer stack handed one more cache slot than its layers keep, holding None: where a
    stage lacks a kind of layer, the model's mask of that kind is made from it (as without a
    cache) and never used, instead of from another kind's cache, whose make_mask differs."""

    layers: list[nn.Module]  # the model's own: this class is mixed into the model's class

    def __call__(self, inputs: mx.array, cache: list | None = None, **kwargs: object) -> mx.array:
        padded = [*(cache if cache is not None else [None] * len(self.layers)), None]
        return super().__call__(inputs, cache=padded, **kwargs)  # type: ignore[misc]


def _first_cached(
    inner: nn.Module,
    kinds: list[str],
    names: tuple[tuple[str, str], ...] = (("fa_idx", "*"), ("ssm_idx", "M")),
) -> None:
    """Nemotron-H (and LFM2) find their masks' caches by their index among the layers that
    keep one (recurrent "M" and attention "*"): fa_idx and ssm_idx (LFM2's conv_idx) follow
    the stage's own layers; for a kind the stage lacks, the index of a None slot after them
    (`_OneMoreCache`)."""
    cached = [k for k in kinds if k in ("M", "*")]
    for name, kind in names:
        if hasattr(inner, name):
            setattr(inner, name, cached.index(kind) if kind in cached else len(cached))
    if "*" not in cached or "M" not in cached:
        cls = type(inner)
        inner.__class__ = type(cls.__name__, (_OneMoreCache, cls), {})


def _shard_vocab(
    model: nn.Module,
    table: ArchTable,
    slicer: WeightSlicer,
    plan: ShardPlan,
    rank: int,
    group: mx.distributed.Group,
    dtype: mx.Dtype | None,
    first: bool,
    last: bool,
) -> None:
    """Vocab-parallel embedding (first stage; last too when tied) and LM head (last stage)."""
    # The model's own structure says whether the head is tied (gemma3 decides by the weights).
    tied = not has_path(model, table.lm_head)
    sizes = [r.vocab.size for r in plan.ranks]
    rows = RankSelector(plan, rank).ranges(Dim.VOCAB)
    if first or (last and tied):
        embedding = get_path(model, table.embedding)
        if dtype is not None:
            embedding.set_dtype(dtype)
        # The dtype a lookup yields (MX-FP4 tables give bfloat16 whatever the compute dtype;
        # only graph-building, nothing is read): a rank holding no vocab rows must send zeros
        # of exactly that dtype to the embedding's all-reduce, or the ranks' bytes differ.
        lookup_dtype = embedding(mx.zeros((1,), dtype=mx.int32)).dtype
        # (vocab, hidden): output rows are tokens
        slicer.slice_rows(table.embedding, embedding, rows, plan.spec.vocab_size)
        set_path(
            model,
            table.embedding,
            VocabParallelEmbedding(
                embedding,
                plan.ranks[rank].vocab.start,
                sizes,
                plan.spec.hidden_size,
                lookup_dtype,
                group,
            ),
        )
        for path in table.vocab_tables:
            if has_path(model, path):
                _vocab_table(model, path, slicer, plan, rank, group, dtype)
    else:
        set_path(model, table.embedding, Absent("the embedding"))
        for path in table.vocab_tables:
            if has_path(model, path):
                set_path(model, path, Absent(f"the {path} table"))
    if tied and last and table.untie_attr:  # its forward would read the embedding's weight
        setattr(model, table.untie_attr, False)
        set_path(model, table.lm_head, TiedHead(get_path(model, table.embedding)))
    if not first:  # a later stage embeds the previous stage's hidden state
        set_path(model, table.embedding, HiddenFeed(get_path(model, table.embedding)))
    if not tied:
        if last:
            head = get_path(model, table.lm_head)
            slicer.slice_rows(table.lm_head, head, rows, plan.spec.vocab_size)
            set_path(model, table.lm_head, VocabParallelHead(head, sizes, group))
        else:
            set_path(model, table.lm_head, Absent("the LM head"))


def _vocab_table(
    model: nn.Module,
    path: str,
    slicer: WeightSlicer,
    plan: ShardPlan,
    rank: int,
    group: mx.distributed.Group,
    dtype: mx.Dtype | None,
) -> None:
    """Another token-indexed table (ArchTable.vocab_tables): this rank's vocabulary rows, its
    lookups summed over ranks, like the embedding; kept whole if its vocabulary differs."""
    table = get_path(model, path)
    if dtype is not None:
        table.set_dtype(dtype)
    probe = table(mx.zeros((1,), dtype=mx.int32))  # graph only: width and lookup dtype
    if table["weight"].shape[0] != plan.spec.vocab_size:
        return
    rows = RankSelector(plan, rank).ranges(Dim.VOCAB)
    slicer.slice_rows(path, table, rows, plan.spec.vocab_size)
    sizes = [r.vocab.size for r in plan.ranks]
    start = plan.ranks[rank].vocab.start
    wrapped = VocabParallelEmbedding(table, start, sizes, probe.shape[-1], probe.dtype, group)
    set_path(model, path, wrapped)


def _whole_layers(
    model: nn.Module,
    table: ArchTable,
    plan: ShardPlan,
    dtype: mx.Dtype | None,
    layers: Span | None,
    first: bool,
    last: bool,
    adapter_path: Path | None,
) -> nn.Module:
    """A model without a tensor-parallel table (exo_tp.arch.generic): one rank holds whole
    layers. Whole on one node it is mlx-lm's model unmodified; as a pipeline stage it keeps its
    layer slice, a later stage's embedding becomes a `HiddenFeed` (holding the embedding only
    where the last stage's tied head multiplies by it) and a stage before the last drops its
    final norm and head. An adapter is mlx-lm's own, applied to the whole model first."""
    if plan.size != 1:
        raise ValueError(f"{plan.spec.model_type} has no tensor-parallel table: one rank a stage")
    if adapter_path is not None:  # mlx-lm's own LoRA, on whole layers, before the slice
        from mlx_lm.tuner.utils import load_adapters

        model = load_adapters(model, str(adapter_path))
    keep = getattr(model, "cast_predicate", lambda _: True)
    if layers is not None and not (first and last):
        tied = not has_path(model, table.lm_head)
        _keep_layers(model, table, layers)
        if not last:
            set_path(model, table.norm, nn.Identity())
            if not tied:
                set_path(model, table.lm_head, Absent("the LM head"))
        if not first:
            held = get_path(model, table.embedding) if last and tied else Absent("the embedding")
            set_path(model, table.embedding, HiddenFeed(held))
    _finish(model, dtype, keep)
    return model


def load_shard(
    model_dir: Path,
    plan: ShardPlan,
    rank: int,
    group: mx.distributed.Group,
    dtype: mx.Dtype | None = None,
    layers: Span | None = None,
    first: bool = True,
    last: bool = True,
    adapter_path: Path | None = None,
) -> nn.Module:
    """The model with only rank ``rank``'s slices, ready to run inside ``group``.

    For a pipeline stage, ``layers`` limits the blocks held; ``first``/``last`` say whether the
    stage holds the embedding and the final norm + LM head. ``adapter_path``: an mlx-lm LoRA
    adapter folder, applied unfused to this rank's slices (exo_tp.shard.adapters).
    """
    model_dir = Path(model_dir)
    table = table_for(plan.spec.model_type)
    model, _, slicer = load_lazily(model_dir)
    if not table.split:
        return _whole_layers(model, table, plan, dtype, layers, first, last, adapter_path)
    ranks = [RankSelector(plan, r) for r in range(plan.size)]
    sharder = BlockSharder(table, slicer, ranks, rank, plan.spec.hidden_size, group)
    layers = layers or Span(start=0, stop=plan.spec.num_layers)
    blocks = get_path(model, table.layers)
    adapter = read_adapter(adapter_path) if adapter_path else None
    if adapter:
        check_layers(adapter, table, len(blocks))
    keep = getattr(model, "cast_predicate", lambda _: True)
    for i in range(layers.start, layers.stop):
        prefix = f"{table.layers}.{i}"
        sharder.shard(blocks[i], prefix, i)
        if adapter:
            apply_to_block(adapter, blocks[i], prefix, table, ranks[rank].layer(i))
        _finish(blocks[i], dtype, _kept_under(keep, prefix))
    _keep_layers(model, table, layers)
    if not last:
        set_path(model, table.norm, nn.Identity())
    _shard_vocab(model, table, slicer, plan, rank, group, dtype, first, last)
    _finish(model, dtype, keep)
    if table.batch_by_sequence:
        batch_by_sequence(get_path(model, table.stack))
    if table.stage_state and not (first and last):
        link_stages(model, table, plan, layers, first, last, dtype)
    return model
