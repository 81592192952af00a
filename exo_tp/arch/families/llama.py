"""Llama, Mistral and Qwen 3 (dense): the plain tensor-parallel split."""

from __future__ import annotations

from exo_tp.arch.dims import Dim
from exo_tp.arch.families._rules import ATTENTION, HEAD_COUNTS, MLP, QK_NORMS, attention, glu
from exo_tp.arch.family import Family
from exo_tp.arch.table import ArchTable, FusedBlock

# q/k/v by heads, o_proj and down_proj row-parallel, gate/up by FFN rows; layer norms and
# per-head q/k norms replicated. The llama-like families below build on it.
LLAMA_LIKE = ArchTable(
    model_types=("llama", "mistral", "qwen3"),
    linears=(*attention(), *glu("mlp", Dim.FFN)),
    branches=(ATTENTION, MLP),
    replicated=QK_NORMS,
    counts=HEAD_COUNTS,
    stages=True,
    fused=FusedBlock(),
)

FAMILY = Family(tables=(LLAMA_LIKE,))
