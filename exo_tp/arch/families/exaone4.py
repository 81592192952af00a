"""EXAONE 4: per-head q/k norms, sliding and global layers."""

from __future__ import annotations

from exo_tp.arch.dims import Dim
from exo_tp.arch.families._rules import ATTENTION, HEAD_COUNTS, MLP, QK_NORMS, attention, glu
from exo_tp.arch.family import Family
from exo_tp.arch.table import ArchTable

# EXAONE 4: per-head q/k norms (replicated), post-norms on the reduced branch outputs,
# sliding-window layers with rotary embeddings and global layers without.
EXAONE4 = ArchTable(
    model_types=("exaone4",),
    linears=(*attention(), *glu("mlp", Dim.FFN)),
    branches=(ATTENTION, MLP),
    replicated=QK_NORMS,
    counts=HEAD_COUNTS,
    stages=True,
)

FAMILY = Family(tables=(EXAONE4,))
