"""EXAONE MoE: ERNIE 4.5 MoE's split with per-head q/k norms."""

from __future__ import annotations

from exo_tp.arch.families._rules import QK_NORMS
from exo_tp.arch.families.ernie import ERNIE45_MOE
from exo_tp.arch.family import Family
from exo_tp.frozen import replace

# EXAONE MoE: the same split with per-head q/k norms (replicated) and a grouped sigmoid router
# (its weight and score-correction bias replicated); sliding-window layers keep a
# RotatingKVCache of the local heads, the global ones use no rope.
EXAONE_MOE = replace(
    ERNIE45_MOE, model_types=("exaone_moe",), replicated=(*QK_NORMS, "mlp.gate"), tie_default=False
)

FAMILY = Family(tables=(EXAONE_MOE,))
