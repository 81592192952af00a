"""Every model family, in one explicit list: their tables (TABLES) and config readers by model
type (pure: no MLX).

An explicit list rather than a scan of the package (pkgutil): TABLES keeps a fixed order that
reads like a changelog of the families (a scan would sort them by file name), a family module
that fails to import fails here loudly instead of vanishing from the scan, and type checkers and
"go to definition" follow the imports. Adding a family is one import and one line below.
"""

from __future__ import annotations

from exo_tp.arch.families import (
    bailing_moe,
    deepseek,
    deepseek_dsa,
    deepseek_v41,
    ernie,
    exaone4,
    exaone_moe,
    gemma,
    gemma4,
    glm4_moe,
    glm4_moe_lite,
    gpt_oss,
    kimi_k2,
    kimi_k3,
    lfm2,
    llama,
    llama4,
    minimax,
    ministral3,
    mistral4,
    mixtral,
    nemotron_h,
    olmo3,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3_moe,
    qwen3_next,
    qwen3_vl,
    seed_oss,
    smollm3,
    step3p5,
)
from exo_tp.arch.family import USUAL, Config, Family
from exo_tp.arch.model_spec import LinearAttention
from exo_tp.arch.table import ArchTable

FAMILIES: tuple[Family, ...] = tuple(
    module.FAMILY
    for module in (
        llama,
        qwen2,
        gemma,
        phi3,
        mixtral,
        qwen3_moe,
        qwen2_moe,
        deepseek,
        gpt_oss,
        ernie,
        exaone_moe,
        bailing_moe,
        minimax,
        olmo3,
        gemma4,
        smollm3,
        seed_oss,
        exaone4,
        ministral3,
        llama4,
        qwen3_vl,
        glm4_moe,
        glm4_moe_lite,
        mistral4,
        kimi_k2,
        deepseek_dsa,
        step3p5,
        deepseek_v41,
        kimi_k3,
        nemotron_h,
        lfm2,
        qwen3_next,
    )
)

TABLES: tuple[ArchTable, ...] = tuple(table for family in FAMILIES for table in family.tables)


def _by_model_type() -> dict[str, Family]:
    out: dict[str, Family] = {}
    for family in FAMILIES:
        for model_type in family.model_types:
            if model_type in out:  # table_for would silently pick the first
                raise ValueError(f"model type {model_type!r} is in two families' tables")
            out[model_type] = family
    return out


_BY_MODEL_TYPE = _by_model_type()


def family_for(model_type: str) -> Family:
    """The family whose table names ``model_type``; USUAL (no hooks) for any other."""
    return _BY_MODEL_TYPE.get(model_type, USUAL)


def linear_attention(c: Config) -> LinearAttention | None:
    """The linear-attention layers some family's reader recognises in settings ``c`` (any
    model's: mlx-lm models without a table have such layers too), None where none does."""
    for family in FAMILIES:
        if family.linear_attention is not None:
            found = family.linear_attention(c)
            if found is not None:
                return found
    return None
