"""Load one rank's shard of an mlx-lm model according to a ShardPlan and the architecture table.

mlx-lm builds the model (its own classes, quantization layout and sanitize) with lazy weights;
each block is then sharded by its table (exo_tp.shard.blocks), each slice read straight from the
files, and evaluated block by block so a rank's peak memory stays near its share. Embedding and
LM head are vocab-parallel.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from exo_tp.arch import ArchTable, table_for
from exo_tp.plan import ShardPlan, Span
from exo_tp.plan.slices import RankSelector
from exo_tp.shard.adapters import apply_to_block, check_layers, read_adapter
from exo_tp.shard.blocks import BlockSharder
from exo_tp.shard.layers import Absent, TiedHead, VocabParallelEmbedding, VocabParallelHead
from exo_tp.shard.slicing import WeightSlicer, load_lazily
from exo_tp.shard.tree import get_path, has_path, set_path


def _finish(module: nn.Module, dtype: mx.Dtype | None) -> None:
    if dtype is not None:
        module.set_dtype(dtype)  # floating parameters only; packed uint32 weights stay
    mx.eval(module.parameters())


def _keep_layers(model: nn.Module, table: ArchTable, layers: Span) -> None:
    """Only this stage's blocks stay; HF-style per-layer type lists follow the slice."""
    blocks = get_path(model, table.layers)
    set_path(model, table.layers, blocks[layers.start : layers.stop])
    inner = get_path(model, table.layers.rpartition(".")[0])
    types = getattr(inner, "layer_types", None)
    if types is not None:
        inner.layer_types = types = types[layers.start : layers.stop]
        if hasattr(inner, "fa_idx"):  # mlx-lm llama: the layers whose caches make the masks
            inner.fa_idx = types.index("full_attention") if "full_attention" in types else 0
        if hasattr(inner, "swa_idx"):
            sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
            inner.swa_idx = sliding[0] if sliding else None


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
    rows = RankSelector(plan, rank).ranges("vocab")
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
    rows = RankSelector(plan, rank).ranges("vocab")
    slicer.slice_rows(path, table, rows, plan.spec.vocab_size)
    sizes = [r.vocab.size for r in plan.ranks]
    start = plan.ranks[rank].vocab.start
    wrapped = VocabParallelEmbedding(table, start, sizes, probe.shape[-1], probe.dtype, group)
    set_path(model, path, wrapped)


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
    ranks = [RankSelector(plan, r) for r in range(plan.size)]
    sharder = BlockSharder(table, slicer, ranks, rank, plan.spec.hidden_size, group)
    layers = layers or Span(start=0, stop=plan.spec.num_layers)
    blocks = get_path(model, table.layers)
    adapter = read_adapter(adapter_path) if adapter_path else None
    if adapter:
        check_layers(adapter, table, len(blocks))
    for i in range(layers.start, layers.stop):
        sharder.shard(blocks[i], f"{table.layers}.{i}", i)
        if adapter:
            apply_to_block(adapter, blocks[i], f"{table.layers}.{i}", table, ranks[rank].layer(i))
        _finish(blocks[i], dtype)
    _keep_layers(model, table, layers)
    if not last:
        set_path(model, table.norm, nn.Identity())
    _shard_vocab(model, table, slicer, plan, rank, group, dtype, first, last)
    _finish(model, dtype)
    return model
