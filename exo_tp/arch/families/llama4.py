"""Llama 4 (mlx-lm's llama4_text): dense, its head named "output"."""

from __future__ import annotations

from exo_tp.arch.dims import Dim
from exo_tp.arch.families._rules import ATTENTION, HEAD_COUNTS, attention, glu
from exo_tp.arch.family import Config, Family, text_config
from exo_tp.arch.table import ArchTable, BranchRule

# mlx-lm's llama4_text: dense (feed_forward sized intermediate_size_mlp), weightless per-head
# q/k norms, no-rope layers; untied head named "output", tied head read from the embedding's
# weight (untie_attr, as Seed-OSS).
LLAMA4_TEXT = ArchTable(
    model_types=("llama4_text",),
    linears=(*attention(), *glu("feed_forward", Dim.FFN)),
    branches=(ATTENTION, BranchRule(path="feed_forward", kind="mlp")),
    counts=HEAD_COUNTS,
    lm_head="output",
    untie_attr="tie_word_embeddings",
    stages=True,
)


def settings(config: Config) -> Config:
    """mlx-lm's llama4_text is dense whatever config.json says about experts."""
    c = text_config(config)
    return {k: v for k, v in c.items() if k not in ("num_local_experts", "num_experts_per_tok")}


FAMILY = Family(tables=(LLAMA4_TEXT,), settings=settings)
