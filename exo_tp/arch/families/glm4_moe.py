"""GLM-4.5/4.6 (glm4_moe): GQA attention and a DeepSeek-style MoE."""

from __future__ import annotations

from exo_tp.arch.families._rules import (
    ATTENTION,
    DEEPSEEK_MOE,
    DEEPSEEK_MOE_BRANCHES,
    HEAD_COUNTS,
    QK_NORMS,
    attention,
)
from exo_tp.arch.family import Family
from exo_tp.arch.table import ArchTable

# GLM-4.5/4.6 (glm4_moe): GQA attention like Llama (q/k/v column-parallel by heads with their
# biases, o row-parallel); the per-head q/k norms and the partial rotary embedding act within
# each head, so they need nothing but the local head counts. Dense first layers
# (first_k_dense_replace) share the "mlp" path with the MoE layers.
GLM4_MOE = ArchTable(
    model_types=("glm4_moe",),
    linears=(*attention(), *DEEPSEEK_MOE),
    branches=(ATTENTION, *DEEPSEEK_MOE_BRANCHES),
    replicated=(*QK_NORMS, "mlp.gate"),
    counts=HEAD_COUNTS,
    tie_default=False,
    stages=True,
)

FAMILY = Family(tables=(GLM4_MOE,))
