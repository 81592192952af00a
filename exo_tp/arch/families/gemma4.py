"""Gemma 4 (text, and its multimodal checkpoints): per-layer head widths, KV sharing,
per-layer input embeddings, a MoE block beside the MLP."""

from __future__ import annotations

from typing import Any

from exo_tp.arch.dims import Dim
from exo_tp.arch.families._rules import (
    HEAD_COUNTS,
    LANGUAGE_MODEL,
    MLP,
    QK_NORMS,
    attention,
    glu,
)
from exo_tp.arch.family import Config, Family, SpecFields, text_config
from exo_tp.arch.model_spec import LayerVariant
from exo_tp.arch.table import ArchTable, BranchRule
from exo_tp.frozen import replace

# Gemma 4 (text): q/k/v by heads, o_proj row-parallel, in every layer; a layer's head width,
# KV heads and FFN width come from its variant (ModelSpec.variants: global layers' wider heads
# and, with K = V, fewer KV heads; KV-shared layers' double-wide MLP), all on the same query
# heads, so a KV-shared layer holds exactly the KV slots of the layer it borrows them from.
# Per-head q/k norms are replicated (v_norm has no weight). The MoE block's dense MLP and its
# experts each have their own post-norm: two reducing branches. The router, the per-layer
# input gate and projection, and the layer scalar are replicated (small, outside the
# branches); the per-layer input embeddings (vocab x layers x width, as big as the rest of
# E2B) are vocab-split like the embedding: one more all-reduce per forward instead of a
# replica on every rank.
GEMMA4_TEXT = ArchTable(
    model_types=("gemma4_text",),
    linears=(
        *attention(),
        *glu("mlp", Dim.FFN),
        *glu("experts.switch_glu", Dim.EXPERT_FFN),
    ),
    branches=(
        BranchRule(path="self_attn", kind="attention", shares_kv=True),
        MLP,
        BranchRule(path="experts", kind="mlp"),
    ),
    replicated=QK_NORMS,
    counts=HEAD_COUNTS,
    vocab_tables=("model.embed_tokens_per_layer",),
)

# Gemma 4 checkpoints (multimodal wrapper): the same text model under language_model; only
# text prompts (the vision and audio towers are dropped by mlx-lm's sanitize).
GEMMA4 = replace(
    GEMMA4_TEXT,
    model_types=("gemma4",),
    **LANGUAGE_MODEL,
    vocab_tables=("language_model.model.embed_tokens_per_layer",),
)

# mlx-lm's gemma4_text.ModelArgs defaults for the keys read here, where config.json omits them.
_DEFAULTS: dict[str, Any] = {
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "global_head_dim": 512,
    "num_kv_shared_layers": 20,
    "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262144,
    "use_double_wide_mlp": True,
    "sliding_window_pattern": 5,
    "attention_k_eq_v": False,
    "enable_moe_block": False,
}


def settings(config: Config) -> Config:
    """The text model's settings over mlx-lm's defaults."""
    c = {**_DEFAULTS, **text_config(config)}
    if config["model_type"] == "gemma4":  # mlx-lm's wrapper imposes its own vocab size
        c["vocab_size"] = config.get("vocab_size", 262144)
    if not c["enable_moe_block"]:  # experts settings mean nothing without the MoE block
        c = {k: v for k, v in c.items() if k not in ("num_experts", "moe_intermediate_size")}
    return c


def fields(c: Config) -> SpecFields:
    """Gemma 4's per-layer sizes: global layers' head width and KV heads, KV-shared layers
    (no K/V, double-wide MLP), per-layer input embeddings, the MoE block beside the MLP."""
    layers = int(c["num_hidden_layers"])
    types = c.get("layer_types") or [
        "full_attention" if (i + 1) % int(c["sliding_window_pattern"]) == 0 else "sliding_attention"
        for i in range(layers)
    ]
    variants = []
    full = tuple(i for i, t in enumerate(types) if t == "full_attention")
    global_kv = c.get("num_global_key_value_heads") if c["attention_k_eq_v"] else None
    if full and (c.get("global_head_dim") or global_kv):
        variants.append(
            LayerVariant(
                layers=full,
                head_dim=c.get("global_head_dim") or None,
                num_kv_heads=global_kv,
            )
        )
    first_shared = layers - int(c["num_kv_shared_layers"])
    shared = tuple(range(first_shared, layers)) if 0 < first_shared < layers else ()
    wide = bool(shared and c["use_double_wide_mlp"])
    if shared:
        variants.append(
            LayerVariant(layers=shared, has_kv=False, ffn={Dim.FFN: Dim.FFN_WIDE} if wide else {})
        )
    per_layer = int(c.get("hidden_size_per_layer_input") or 0)
    same_vocab = int(c["vocab_size_per_layer_input"]) == int(c["vocab_size"])
    return {
        "variants": tuple(variants),
        "extra_ffn": {Dim.FFN_WIDE: 2 * int(c["intermediate_size"])} if wide else {},
        "per_layer_embedding": layers * per_layer if same_vocab else 0,
        "dense_mlp_with_experts": bool(c["enable_moe_block"]),
        "experts_per_token": int(c.get("top_k_experts") or 0),
    }


FAMILY = Family(tables=(GEMMA4_TEXT, GEMMA4), settings=settings, fields=fields)
