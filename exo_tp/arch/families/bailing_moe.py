"""Ling / Bailing MoE: packed q|k|v under "attention", a normalised LM head."""

from __future__ import annotations

from exo_tp.arch.dims import Dim
from exo_tp.arch.families._rules import DEEPSEEK_MOE, DEEPSEEK_MOE_BRANCHES, col, row
from exo_tp.arch.family import Family
from exo_tp.arch.table import ArchTable, BranchRule, CountRule

# Ling / Bailing MoE: packed q|k|v ("query_key_value", split part by part as phi3's) and a
# row-parallel "dense" output under "attention"; per-head q/k norms replicated; grouped top-k
# router with its expert bias replicated; shared experts as an MLP inside the MoE branch. A
# normalised LM head (norm_head: sanitize divides each column by its norm over the whole
# vocabulary) is computed by mlx-lm's own load before the rows are cut.
BAILING_MOE = ArchTable(
    model_types=("bailing_moe",),
    linears=(
        col("attention.query_key_value", Dim.Q_HEADS, Dim.KV_HEADS, Dim.KV_HEADS),
        row("attention.dense", Dim.Q_HEADS),
        *DEEPSEEK_MOE,
    ),
    branches=(BranchRule(path="attention", kind="attention"), *DEEPSEEK_MOE_BRANCHES),
    replicated=("attention.query_layernorm", "attention.key_layernorm", "mlp.gate"),
    counts=(
        CountRule(path="attention.num_attention_heads", dim=Dim.Q_HEADS),
        CountRule(path="attention.num_key_value_heads", dim=Dim.KV_HEADS),
    ),
    embedding="model.word_embeddings",
    tie_default=False,
    reads_head_dim=False,
    stages=True,
)

FAMILY = Family(tables=(BAILING_MOE,))
