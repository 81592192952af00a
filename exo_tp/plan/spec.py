"""What the planner needs to know about a model, read from its config.json (no MLX).

Every model is read alike: its family's hooks (exo_tp.arch.family.Family, found through
exo_tp.arch.registry by model type) supply the settings and the fields only that family has;
the usual sizes are read here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from exo_tp.arch import table_for
from exo_tp.arch.dims import Dim
from exo_tp.arch.family import Family
from exo_tp.arch.model_spec import (
    CompressedAttention,
    LatentAttention,
    LayerVariant,
    LinearAttention,
    ModelSpec,
    Quantization,
    linear_head_widths,
)
from exo_tp.arch.registry import family_for, linear_attention
from exo_tp.arch.table import ArchTable
from exo_tp.errors import ExoTpError
from exo_tp.frozen import Frozen, replace
from exo_tp.plan.mtp import declared_mtp, heads_bytes

# The spec's parts are defined in exo_tp.arch.model_spec (family readers build them); they are
# read from here as the planner's vocabulary.
__all__ = [
    "CompressedAttention",
    "Frozen",
    "LatentAttention",
    "LayerVariant",
    "LinearAttention",
    "ModelSpec",
    "Quantization",
    "linear_head_widths",
    "load_spec",
    "spec_from_config",
]


# Legacy quantization_config methods that mlx-lm loads as packed groups of 32 (utils.load_model).
_LEGACY_GROUPS = {"mxfp4": {"group_size": 32, "bits": 4}, "mxfp8": {"group_size": 32, "bits": 8}}


# compressed-tensors formats mlx-lm loads packed (utils._compressed_tensors_quantization), e.g.
# Kimi K2.5's int4 experts ("pack-quantized": affine 4-bit in groups of 32).
_COMPRESSED_TENSORS_GROUPS = {
    "pack-quantized": {"group_size": 32, "bits": 4},
    "mxfp4-pack-quantized": {"group_size": 32, "bits": 4},
    "nvfp4-pack-quantized": {"group_size": 16, "bits": 4},
}


def _legacy_quantization(config: dict[str, Any]) -> dict[str, Any] | None:
    # mlx-lm also reads a multimodal wrapper's quantization_config from its text_config.
    legacy = config.get("quantization_config") or (config.get("text_config") or {}).get(
        "quantization_config"
    )
    if not legacy:
        return None
    method = str(legacy.get("quant_method"))
    if method == "compressed-tensors":
        return _COMPRESSED_TENSORS_GROUPS.get(str(legacy.get("format")))
    return _LEGACY_GROUPS.get(method)


def _quantization(config: dict[str, Any]) -> Quantization | None:
    quant = config.get("quantization") or _legacy_quantization(config)
    if not quant:
        return None
    # Per-module overrides may use other group sizes; a split must respect all of them.
    groups = [quant["group_size"]] + [
        v["group_size"] for v in quant.values() if isinstance(v, dict) and "group_size" in v
    ]
    return Quantization(
        group_size=math.lcm(*groups),
        bits=quant["bits"],
        embedding_bits=_module_bits(quant, "embed_tokens"),
        head_bits=_module_bits(quant, "lm_head"),
    )


def _module_bits(quant: dict[str, Any], name: str) -> int | None:
    """The bits a per-module entry gives the module ``name`` (the last part of its path)."""
    for path, entry in quant.items():
        if isinstance(entry, dict) and path.split(".")[-1] == name and "bits" in entry:
            return int(entry["bits"])
    return None


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def _ffn_sizes(c: dict[str, Any]) -> dict[Dim, int]:
    if c.get("intermediate_size_mlp"):  # mlx-lm's llama4_text: its MLP's width
        return {Dim.FFN: int(c["intermediate_size_mlp"])}
    ffn = {Dim.FFN: int(c["intermediate_size"])} if c.get("intermediate_size") else {}
    if c.get("moe_intermediate_size"):
        ffn[Dim.EXPERT_FFN] = int(c["moe_intermediate_size"])
    # Shared experts run as one MLP of all their rows: deepseek's n_shared_experts, ERNIE's
    # moe_num_shared_experts, Bailing's num_shared_experts (of its own width when it has one).
    shared = (
        c.get("n_shared_experts") or c.get("moe_num_shared_experts") or c.get("num_shared_experts")
    )
    shared_width = c.get("moe_shared_expert_intermediate_size") or c.get("moe_intermediate_size")
    if c.get("shared_expert_intermediate_size"):  # qwen2_moe
        ffn[Dim.SHARED_EXPERT_FFN] = int(c["shared_expert_intermediate_size"])
    elif shared and shared_width:
        ffn[Dim.SHARED_EXPERT_FFN] = int(shared_width) * int(shared)
    return ffn


def _dense_layers(c: dict[str, Any]) -> int:
    """Leading layers with a dense FFN (DeepSeek's first_k_dense_replace, ERNIE's MoE start,
    EXAONE's per-layer is_moe_layer flags, the leading run of Qwen's mlp_only_layers)."""
    flags = c.get("is_moe_layer")
    if isinstance(flags, list):
        return next((i for i, moe in enumerate(flags) if moe), len(flags))
    dense = c.get("mlp_only_layers")
    if isinstance(dense, list) and dense:
        return next(i for i in range(len(dense) + 1) if i not in dense)
    start = c.get("first_k_dense_replace") or c.get("moe_layer_start_index") or 0
    return int(min(start) if isinstance(start, list) else start)


def _heads(c: dict[str, Any], reads_head_dim: bool) -> tuple[int, int, dict[str, int]]:
    """(KV heads, head_dim, other head widths)."""
    heads = int(c["num_attention_heads"])
    if c.get("kv_lora_rank") is not None:
        # MLA: every head has its own keys and values (no GQA); a query head is nope + rope
        # wide, its slice of kv_b nope + v, its attention output v.
        nope, rope = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"])
        v = int(c["v_head_dim"])
        return heads, nope + rope, {"kv_b_head_dim": nope + v, "v_head_dim": v}
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = c.get("head_dim") if reads_head_dim else None
    return kv_heads, int(head_dim or int(c["hidden_size"]) // heads), {}


# mlx-lm's DeepSeek V2 decompresses the latent into per-head keys and values in its cache.

_PER_HEAD_MLA_CACHE = frozenset({"deepseek_v2"})


def _latent_attention(model_type: str, c: dict[str, Any]) -> LatentAttention | None:
    if c.get("kv_lora_rank") is None:
        return None
    return LatentAttention(
        q_lora_rank=int(c.get("q_lora_rank") or 0),
        kv_lora_rank=int(c["kv_lora_rank"]),
        rope_dim=int(c["qk_rope_head_dim"]),
        latent_cache=model_type not in _PER_HEAD_MLA_CACHE,
        index_heads=int(c.get("index_n_heads") or 0),
        index_head_dim=int(c.get("index_head_dim") or 0) if c.get("index_n_heads") else 0,
        output_gate=bool(c.get("mla_use_output_gate")),
    )


# Other names for the sizes the cost model needs, in configs of models without a table
# (GPT-2 style n_embd/n_layer/n_head, d_model, num_layers, num_heads).
_GENERIC_ALIASES = {
    "hidden_size": ("n_embd", "d_model", "dim", "model_dim"),
    "num_hidden_layers": ("n_layer", "n_layers", "num_layers"),
    "num_attention_heads": ("n_head", "n_heads", "num_heads"),
    "intermediate_size": ("n_inner", "ffn_dim", "d_ff"),
}


def _generic_names(c: dict[str, Any]) -> dict[str, Any]:
    """A model without a table is never split inside its layers: its config only prices it
    (bytes per layer, KV cache), so missing attention sizes fall back to one head (a
    state-space model has none)."""
    out = dict(c)
    for name, others in _GENERIC_ALIASES.items():
        if out.get(name) is None:
            out[name] = next((c[o] for o in others if c.get(o) is not None), None)
    if out.get("num_attention_heads") is None:
        out["num_attention_heads"] = 1
    return {k: v for k, v in out.items() if v is not None}


def _experts(c: dict[str, Any], top_k: int) -> dict[str, Any]:
    """Mixture-of-experts sizes under their many names (0: dense); ``top_k``: the family's own
    reading of the experts per token, where the usual names lack it."""
    return {
        "num_experts": int(
            c.get("num_local_experts")
            or c.get("num_experts")
            or c.get("n_routed_experts")
            or c.get("moe_num_experts")
            or 0
        ),
        "experts_per_token": int(
            c.get("num_experts_per_tok")
            or c.get("num_experts_per_token")  # Kimi K3
            or c.get("experts_per_token")
            or c.get("moe_k")
            or top_k
        ),
        "dense_layers": _dense_layers(c),
    }


def _read(config: dict[str, Any], table: ArchTable, family: Family) -> ModelSpec:
    """The spec from config.json: the family's settings and fields, the usual sizes, and any
    linear-attention layers a family recognises."""
    model_type = str(config["model_type"])
    c = family.settings(config)
    if not table.split:
        c = _generic_names(c)
    extra = dict(family.fields(c)) if family.fields else {}
    extra_ffn = extra.pop("extra_ffn", {})
    top_k = extra.pop("experts_per_token", 0)
    kv_heads, head_dim, head_widths = _heads(c, table.reads_head_dim)
    head_widths.update(extra.pop("head_widths", {}))
    linear = linear_attention(c)
    if linear is not None:
        head_widths.update(linear_head_widths(linear))
        extra["linear_attention"] = linear
        if linear.gated_deltanet:
            # its full attention's q_proj: per head, the queries then their sigmoid gate
            head_widths["gated_q"] = 2 * head_dim
    return ModelSpec(
        model_type=model_type,
        hidden_size=int(c["hidden_size"]),
        num_layers=int(c["num_hidden_layers"]),
        num_heads=int(c["num_attention_heads"]),
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        head_widths=head_widths,
        ffn_sizes={**_ffn_sizes(c), **extra_ffn},
        vocab_size=int(c["vocab_size"]),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", table.tie_default)),
        dtype_bytes=_DTYPE_BYTES.get(str(c.get("torch_dtype", "bfloat16")), 2),
        quantization=_quantization(config),
        context_length=int(c.get("max_position_embeddings") or 4096),
        **_experts(c, top_k),
        latent_attention=_latent_attention(model_type, c),
        moe_latent=int(c.get("routed_expert_hidden_size") or 0),
        moe_latent_norm=bool(c.get("routed_expert_hidden_size") and c.get("latent_moe_use_norm")),
        attention_residuals=c.get("attn_res_block_size") is not None,
        **extra,
    )


def _check_heads(spec: ModelSpec) -> None:
    """Refuse head counts no split can keep whole: output groups, GQA groups in every layer."""
    attention = spec.compressed_attention
    if attention is not None and spec.num_heads % attention.o_groups:
        raise ExoTpError(
            f"{spec.num_heads} attention heads are not a multiple of {attention.o_groups} "
            "output groups"
        )
    for view in spec.layer_specs():
        if view.num_heads % view.num_kv_heads:
            raise ExoTpError(
                f"{view.num_heads} attention heads are not a multiple of "
                f"{view.num_kv_heads} KV heads"
            )


def spec_from_config(config: dict[str, Any]) -> ModelSpec:
    """The planner's view of a model; refuses an architecture without a table."""
    if "model_type" not in config:
        raise ExoTpError("config.json lacks 'model_type'")
    model_type = str(config["model_type"])
    table = table_for(model_type)
    try:
        spec = _read(config, table, family_for(model_type))
    except KeyError as missing:
        raise ExoTpError(f"config.json lacks {missing.args[0]!r}") from None
    except (TypeError, ValueError) as bad:
        raise ExoTpError(f"config.json has an invalid value: {bad}") from None
    _check_heads(spec)
    return spec


def load_spec(model_dir: Path) -> ModelSpec:
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ExoTpError(f"{path} not found") from None
    except json.JSONDecodeError as bad:
        raise ExoTpError(f"{path} is not valid JSON: {bad}") from None
    spec = spec_from_config(config)
    mtp = heads_bytes(Path(model_dir), config) if declared_mtp(config) else 0
    if mtp:
        spec = replace(spec, mtp_bytes=mtp)
    if config.get("vision_config"):
        from exo_tp.vision.families import image_patches, tower_bytes

        patches = image_patches(config["vision_config"])
        spec = replace(spec, vision_bytes=tower_bytes(Path(model_dir)), vision_patches=patches)
    return spec
