"""One tensor-parallel table per supported mlx-lm architecture."""

from __future__ import annotations

from exo_tp.arch.table import ArchTable, BranchRule, CountRule, LinearRule


def _col(path: str, *parts: str) -> LinearRule:
    return LinearRule(path=path, style="column", parts=parts)


def _row(path: str, *parts: str) -> LinearRule:
    return LinearRule(path=path, style="row", parts=parts)


# q/k/v column-parallel by heads, o row-parallel; gate/up column, down row; norms replicated
# (qwen3's per-head q_norm/k_norm act on head_dim, so they need no split).
LLAMA_LIKE = ArchTable(
    model_types=("llama", "qwen2", "qwen3"),
    linears=(
        _col("self_attn.q_proj", "q_heads"),
        _col("self_attn.k_proj", "kv_heads"),
        _col("self_attn.v_proj", "kv_heads"),
        _row("self_attn.o_proj", "q_heads"),
        _col("mlp.gate_proj", "ffn"),
        _col("mlp.up_proj", "ffn"),
        _row("mlp.down_proj", "ffn"),
    ),
    branches=(BranchRule(path="self_attn", dim="q_heads"), BranchRule(path="mlp", dim="ffn")),
    counts=(
        CountRule(path="self_attn.n_heads", dim="q_heads"),
        CountRule(path="self_attn.n_kv_heads", dim="kv_heads"),
    ),
)

TABLES: tuple[ArchTable, ...] = (LLAMA_LIKE,)
