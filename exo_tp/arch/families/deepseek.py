"""DeepSeek V2/V3: multi-head latent attention (MLA) and a DeepSeek-style MoE."""

from __future__ import annotations

from exo_tp.arch.dims import Dim
from exo_tp.arch.families._rules import (
    ATTENTION,
    DEEPSEEK_MOE,
    DEEPSEEK_MOE_BRANCHES,
    col,
    row,
    stacked,
)
from exo_tp.arch.family import Family
from exo_tp.arch.table import ArchTable, CountRule

# DeepSeek V2/V3 (MLA): split by heads. Per-head projections (q or q_b, V2's kv_b, V3's
# embed_q/unembed_out stacks) follow the query heads, o_proj is row-parallel over heads of
# v_head_dim; the latent projections (q_a, kv_a) and their norms are replicated, so V3's latent
# KV cache is replicated on every rank (V2 caches per-head keys and values: split). Its
# derivatives (GLM-4.7-Flash, Mistral 4, Kimi K2, DeepSeek Sparse Attention) have their own
# families built on it.
DEEPSEEK = ArchTable(
    model_types=("deepseek_v2", "deepseek_v3"),
    linears=(
        col("self_attn.q_proj", Dim.Q_HEADS),
        col("self_attn.q_b_proj", Dim.Q_HEADS),
        col("self_attn.kv_b_proj", Dim.Q_HEADS, width="kv_b_head_dim"),
        stacked("self_attn.embed_q"),
        stacked("self_attn.unembed_out"),
        row("self_attn.o_proj", Dim.Q_HEADS, width="v_head_dim"),
        *DEEPSEEK_MOE,
    ),
    branches=(ATTENTION, *DEEPSEEK_MOE_BRANCHES),
    replicated=(
        "self_attn.q_a_proj",
        "self_attn.q_a_layernorm",
        "self_attn.kv_a_proj_with_mqa",
        "self_attn.kv_a_layernorm",
        "mlp.gate",
    ),
    counts=(CountRule(path="self_attn.num_heads", dim=Dim.Q_HEADS),),
    tie_default=False,
    stages=True,
)

FAMILY = Family(tables=(DEEPSEEK,))
