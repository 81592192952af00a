"""What the planner needs to know about a model, read from its config.json (no MLX)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pydantic import Field

from exo_tp.arch import table_for
from exo_tp.errors import ExoTpError
from exo_tp.frozen import Frozen

__all__ = [
    "Frozen",
    "LatentAttention",
    "ModelSpec",
    "OtherAttention",
    "Quantization",
    "load_spec",
    "spec_from_config",
]


class Quantization(Frozen):
    """Affine quantization of a checkpoint: input-dimension splits must land on groups."""

    group_size: int = Field(gt=0)
    bits: int = Field(gt=0)


class LatentAttention(Frozen):
    """Multi-head latent attention (DeepSeek V2/V3 and kin): what the cost model needs beyond
    the per-head widths. Queries come through a replicated q_lora_rank latent (0: a plain
    q_proj), keys and values through a replicated kv_lora_rank latent plus one shared rope key;
    the per-head parts are split by heads like any attention."""

    q_lora_rank: int = Field(default=0, ge=0)
    kv_lora_rank: int = Field(gt=0)
    rope_dim: int = Field(ge=0)
    # The KV cache holds the latent and the rope key (replicated on every rank holding heads:
    # DeepSeek V3 and kin); otherwise per-head keys and values (mlx-lm's DeepSeek V2).
    latent_cache: bool = True
    # DeepSeek Sparse Attention's indexer (replicated): its heads, their width, and its key
    # cache (one index_head_dim key per token; mlx-lm also keeps values of the same shape).
    index_heads: int = Field(default=0, ge=0)
    index_head_dim: int = Field(default=0, ge=0)


class OtherAttention(Frozen):
    """Layers whose attention has another query-head count, with the same KV heads and head
    width (Step 3.5: 96 query heads in its sliding-window layers, 64 in the others, 8 KV heads
    in both). A rank holds the same fraction of the heads there: its query-head span scaled by
    ``num_heads / ModelSpec.num_heads`` (the planner's head unit keeps that whole), so its KV
    heads are the same in every layer."""

    num_heads: int = Field(gt=0)
    layers: tuple[int, ...]


class ModelSpec(Frozen):
    model_type: str
    hidden_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)  # width of one head in the q/k/v projections
    # Other per-head widths where they differ (MLA: "kv_b_head_dim", "v_head_dim").
    head_widths: dict[str, int] = {}
    # Width of each feed-forward kind that gets split: {"ffn": 1536}, MoE adds "expert_ffn", ...
    ffn_sizes: dict[str, int]
    vocab_size: int = Field(gt=0)
    tie_word_embeddings: bool
    # bytes per float parameter as stored (2 for bf16/fp16, 4 for fp32)
    dtype_bytes: int = 2
    quantization: Quantization | None = None
    context_length: int = 4096
    # Mixture of experts (0: dense). The cost model needs them: an MoE layer holds every
    # expert but a decoded token reads only ``experts_per_token`` of them.
    num_experts: int = Field(default=0, ge=0)
    experts_per_token: int = Field(default=0, ge=0)
    dense_layers: int = Field(default=0, ge=0)  # leading layers with a dense FFN (DeepSeek)
    latent_attention: LatentAttention | None = None
    other_attention: OtherAttention | None = None

    def for_layer(self, layer: int) -> ModelSpec:
        """The spec as layer ``layer`` sees it: its own query-head count (OtherAttention)."""
        other = self.other_attention
        if other is None or layer not in other.layers:
            return self
        return self.model_copy(update={"num_heads": other.num_heads, "other_attention": None})

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def head_width(self, name: str) -> int:
        if name == "head_dim":
            return self.head_dim
        if name not in self.head_widths:
            raise ExoTpError(f"{self.model_type} needs a per-head width {name!r} (config.json)")
        return self.head_widths[name]

    @property
    def input_align(self) -> int:
        """Columns an input-dimension split must be a multiple of (the quantization group)."""
        return self.quantization.group_size if self.quantization else 1


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    # Multimodal wrappers (gemma3, mistral3, ...) nest the language model's settings.
    return {**config, **config["text_config"]} if "text_config" in config else config


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
    return Quantization(group_size=math.lcm(*groups), bits=quant["bits"])


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def _ffn_sizes(c: dict[str, Any]) -> dict[str, int]:
    ffn = {"ffn": int(c["intermediate_size"])} if c.get("intermediate_size") else {}
    if c.get("moe_intermediate_size"):
        ffn["expert_ffn"] = int(c["moe_intermediate_size"])
    # Shared experts run as one MLP of all their rows: deepseek's n_shared_experts, ERNIE's
    # moe_num_shared_experts, Bailing's num_shared_experts (of its own width when it has one).
    shared = (
        c.get("n_shared_experts") or c.get("moe_num_shared_experts") or c.get("num_shared_experts")
    )
    shared_width = c.get("moe_shared_expert_intermediate_size") or c.get("moe_intermediate_size")
    if c.get("shared_expert_intermediate_size"):  # qwen2_moe
        ffn["shared_expert_ffn"] = int(c["shared_expert_intermediate_size"])
    elif shared and shared_width:
        ffn["shared_expert_ffn"] = int(shared_width) * int(shared)
    return ffn


def _dense_layers(c: dict[str, Any]) -> int:
    """Leading layers with a dense FFN (DeepSeek's first_k_dense_replace, ERNIE's MoE start,
    EXAONE's per-layer is_moe_layer flags)."""
    flags = c.get("is_moe_layer")
    if isinstance(flags, list):
        return next((i for i, moe in enumerate(flags) if moe), len(flags))
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
    )


# Step 3.5's names for the usual settings.
_ALIASES = {
    "num_attention_groups": "num_key_value_heads",
    "moe_num_experts": "n_routed_experts",
    "moe_top_k": "num_experts_per_tok",
    "share_expert_dim": "shared_expert_intermediate_size",
}


def _usual_names(c: dict[str, Any]) -> dict[str, Any]:
    out = {**{dst: c[src] for src, dst in _ALIASES.items() if src in c}, **c}
    if "moe_layers_enum" in c:  # Step 3.5: MoE layers listed, else every layer but the first
        enum = str(c["moe_layers_enum"] or "")
        moe = [int(i) for i in enum.split(",") if i.strip()]
        out["first_k_dense_replace"] = min(moe) if moe else 1
    return out


def _other_attention(c: dict[str, Any], kv_heads: int) -> OtherAttention | None:
    """Step 3.5's attention_other_setting: its sliding-window layers' head counts."""
    other = c.get("attention_other_setting")
    if not other:
        return None
    layers = int(c["num_hidden_layers"])
    types = c.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
    ]
    if int(other.get("num_attention_groups", kv_heads)) != kv_heads:
        raise ExoTpError("layers with different KV head counts are not supported")
    if int(other.get("head_dim", c.get("head_dim") or 0)) != int(c.get("head_dim") or 0):
        raise ExoTpError("layers with different head widths are not supported")
    sliding = tuple(i for i, t in enumerate(types[:layers]) if t == "sliding_attention")
    heads = int(other["num_attention_heads"])
    if heads == int(c["num_attention_heads"]) or not sliding:
        return None
    if heads % kv_heads:
        raise ExoTpError(f"{heads} attention heads are not a multiple of {kv_heads} KV heads")
    return OtherAttention(num_heads=heads, layers=sliding)


def spec_from_config(config: dict[str, Any]) -> ModelSpec:
    """The planner's view of a model; refuses an architecture without a table."""
    if "model_type" not in config:
        raise ExoTpError("config.json lacks 'model_type'")
    table = table_for(str(config["model_type"]))
    c = _usual_names(_text_config(config))
    try:
        kv_heads, head_dim, head_widths = _heads(c, table.reads_head_dim)
        if c.get("use_head_wise_attn_gate"):
            head_widths["head_gate"] = 1  # Step 3.5's g_proj: one gate row per query head
        spec = ModelSpec(
            model_type=str(config["model_type"]),
            hidden_size=int(c["hidden_size"]),
            num_layers=int(c["num_hidden_layers"]),
            num_heads=int(c["num_attention_heads"]),
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            head_widths=head_widths,
            ffn_sizes=_ffn_sizes(c),
            vocab_size=int(c["vocab_size"]),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", table.tie_default)),
            dtype_bytes=_DTYPE_BYTES.get(str(c.get("torch_dtype", "bfloat16")), 2),
            quantization=_quantization(config),
            context_length=int(c.get("max_position_embeddings") or 4096),
            num_experts=int(
                c.get("num_local_experts")
                or c.get("num_experts")
                or c.get("n_routed_experts")
                or c.get("moe_num_experts")
                or 0
            ),
            experts_per_token=int(
                c.get("num_experts_per_tok") or c.get("experts_per_token") or c.get("moe_k") or 0
            ),
            dense_layers=_dense_layers(c),
            latent_attention=_latent_attention(str(config["model_type"]), c),
            other_attention=_other_attention(c, kv_heads),
        )
    except KeyError as missing:
        raise ExoTpError(f"config.json lacks {missing.args[0]!r}") from None
    except (TypeError, ValueError) as bad:
        raise ExoTpError(f"config.json has an invalid value: {bad}") from None
    if spec.num_heads % spec.num_kv_heads:
        raise ExoTpError(
            f"{spec.num_heads} attention heads are not a multiple of {spec.num_kv_heads} KV heads"
        )
    return spec


def load_spec(model_dir: Path) -> ModelSpec:
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ExoTpError(f"{path} not found") from None
    except json.JSONDecodeError as bad:
        raise ExoTpError(f"{path} is not valid JSON: {bad}") from None
    return spec_from_config(config)
