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
from mlx_lm.utils import load_model

from exo_tp.arch import ArchTable, table_for
from exo_tp.plan import ShardPlan
from exo_tp.plan.slices import RankSelector
from exo_tp.shard.blocks import BlockSharder
from exo_tp.shard.layers import VocabParallelEmbedding, VocabParallelHead
from exo_tp.shard.slicing import WeightSlicer
from exo_tp.shard.tree import get_path, has_path, set_path


def _finish(module: nn.Module, dtype: mx.Dtype | None) -> None:
    if dtype is not None:
        module.set_dtype(dtype)  # floating parameters only; packed uint32 weights stay
    mx.eval(module.parameters())


def _shard_vocab(model: nn.Module, table: ArchTable, slicer: WeightSlicer, plan: ShardPlan,
                 rank: int, dtype: mx.Dtype | None, group: mx.distributed.Group) -> None:
    vocab = plan.ranks[rank].vocab
    sizes = [r.vocab.size for r in plan.ranks]
    rows = RankSelector(plan, rank).ranges("vocab")
    width = plan.spec.hidden_size
    embedding = get_path(model, table.embedding)
    # (vocab, hidden): output rows are tokens
    slicer.slice_rows(table.embedding, embedding, rows, plan.spec.vocab_size)
    embed_dtype = dtype or (embedding.get("scales", embedding.weight)).dtype
    set_path(model, table.embedding,
             VocabParallelEmbedding(embedding, vocab.start, sizes, width, embed_dtype, group))
    # The model's own structure says whether the head is tied (gemma3 decides by the weights).
    if has_path(model, table.lm_head):
        head = get_path(model, table.lm_head)
        slicer.slice_rows(table.lm_head, head, rows, plan.spec.vocab_size)
        set_path(model, table.lm_head, VocabParallelHead(head, sizes, group))


def load_shard(model_dir: Path, plan: ShardPlan, rank: int, group: mx.distributed.Group,
               dtype: mx.Dtype | None = None) -> nn.Module:
    """The model with only rank ``rank``'s slices, ready to run inside ``group``."""
    model_dir = Path(model_dir)
    table = table_for(plan.spec.model_type)
    model, _ = load_model(model_dir, lazy=True)
    slicer = WeightSlicer(model_dir, model)
    ranks = [RankSelector(plan, r) for r in range(plan.size)]
    blocks = BlockSharder(table, slicer, ranks, rank, plan.spec.hidden_size, group)
    for i, layer in enumerate(get_path(model, table.layers)):
        blocks.shard(layer, f"{table.layers}.{i}")
        _finish(layer, dtype)
    _shard_vocab(model, table, slicer, plan, rank, dtype, group)
    _finish(model, dtype)
    return model
