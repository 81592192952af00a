"""gpt-oss: biased attention with per-head sinks, biased experts."""

from __future__ import annotations

from exo_tp.arch.dims import Dim
from exo_tp.arch.families._rules import (
    ATTENTION,
    ATTENTION_HEAD_COUNTS,
    MLP,
    attention,
    glu,
    stacked,
)
from exo_tp.arch.family import Family
from exo_tp.arch.table import ArchTable, CountRule

# gpt-oss: biased q/k/v/o, one attention sink per query head, biased experts.
GPT_OSS = ArchTable(
    model_types=("gpt_oss",),
    linears=(
        *attention(),
        stacked("self_attn.sinks"),
        *glu("mlp.experts", Dim.FFN),
    ),
    branches=(ATTENTION, MLP),
    replicated=("mlp.router",),
    counts=(
        *ATTENTION_HEAD_COUNTS,
        CountRule(path="self_attn.num_key_value_groups", dim=Dim.REPEATS),
    ),
    tie_default=False,
    stages=True,
)

FAMILY = Family(tables=(GPT_OSS,))
