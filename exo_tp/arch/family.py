"""What one model family declares (pure: no MLX): its tensor-parallel tables and, where its
config.json is unusual, how exo_tp.plan.spec reads it.

A family module (exo_tp.arch.families.<family>) holds one ``FAMILY``; the registry
(exo_tp.arch.registry) lists them. spec_from_config reads every model alike, through these hooks:

1. ``settings``: config.json -> the flat settings the sizes are read from (default: the
   language model's, ``text_config``);
2. the usual sizes (heads, widths, FFN kinds, experts, MLA, quantization) from those settings;
3. ``fields``: settings -> the ModelSpec fields only this family has (``SpecFields``);
4. every family's ``linear_attention`` reader, on any model's settings: a linear-attention
   layer kind is recognised by its own settings, also in mlx-lm models without a table (Kimi
   Linear, OLMo hybrid), which exo_tp still prices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from exo_tp.arch.model_spec import LinearAttention
from exo_tp.arch.table import ArchTable

# A config.json, or the flat settings read from it.
Config = dict[str, Any]
# ModelSpec fields by name, plus what spec_from_config merges into its own reading:
# "extra_ffn" (more ffn_sizes kinds), "head_widths" (more per-head widths) and
# "experts_per_token" (the top-k where the usual names lack it).
SpecFields = dict[str, Any]


def text_config(config: Config) -> Config:
    """The language model's settings: multimodal wrappers (gemma3, mistral3, ...) nest them."""
    return {**config, **config["text_config"]} if "text_config" in config else config


@dataclass(frozen=True)
class Family:
    """One model family: its tables (in TABLES order) and its config readers."""

    tables: tuple[ArchTable, ...]
    settings: Callable[[Config], Config] = text_config
    fields: Callable[[Config], SpecFields] | None = None
    # the family's linear-attention layers from any settings, None where they lack its keys
    linear_attention: Callable[[Config], LinearAttention | None] | None = None

    @property
    def model_types(self) -> tuple[str, ...]:
        return tuple(t for table in self.tables for t in table.model_types)


# A model type without a family (a stages-only table from exo_tp.arch.generic): no hooks.
USUAL = Family(tables=())
