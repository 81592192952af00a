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


class Quantization(Frozen):
    """Affine quantization of a checkpoint: input-dimension splits must land on groups."""

    group_size: int = Field(gt=0)
    bits: int = Field(gt=0)
    # mlx-lm's per-module entries for the vocabulary matrices, where the config overrides them
    # (the 4-bit SmolLM2 keeps an 8-bit embedding, which is also its tied LM head)
    embedding_bits: int | None = Field(default=None, gt=0)
    head_bits: int | None = Field(default=None, gt=0)


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
    # A sigmoid gate on the attention output (Kimi K3's mla_use_output_gate): g_proj, split by
    # heads like o_proj's columns.
    output_gate: bool = False


class LinearAttention(Frozen):
    """Recurrent linear-attention layers (Kimi Delta Attention in Kimi K3 / Kimi Linear, Gated
    DeltaNet in Qwen 3.5 and Qwen3-Next): per head, a short depthwise causal conv over its
    q/k/v channels and a recurrent state (float32) per stream, constant in context length.
    Their heads are a split dimension of their own ("linear_heads", ``head_dim`` wide:
    ModelSpec.head_widths "linear_head_dim"); the other layers are attention as usual.

    Gated DeltaNet groups ``value_heads`` value heads (of ``value_head_dim``) under each key
    head (as GQA groups query heads under a KV head): ``num_heads`` counts key heads, and the
    split unit is a key head with its value heads, whose state is value_head_dim x head_dim
    each. KDA has one value per key head of the same width (``value_heads`` 0)."""

    layers: tuple[int, ...]  # indices of the linear-attention layers
    num_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    conv_kernel: int = Field(gt=0)
    # the output gate is one full-rank projection (g_proj) instead of a low-rank pair (g_a, g_b)
    full_rank_gate: bool = False
    # Gated DeltaNet: value heads per key head and their width (0: KDA)
    value_heads: int = Field(default=0, ge=0)
    value_head_dim: int = Field(default=0, ge=0)
    # Mamba-2 (Nemotron-H): the split unit is a group (num_heads counts groups, head_dim is a
    # group's heads_per_group x mamba head_dim channels), each with its own B and C of
    # state_size channels and a (mamba head_dim x state_size) SSM state per head.
    mamba2: bool = False
    # LFM2's short convolutions: num_heads counts channels (head_dim 1), each with its B, C
    # and x rows of in_proj, a depthwise conv of conv_kernel taps and its (K - 1) inputs.
    short_conv: bool = False
    heads_per_group: int = Field(default=1, gt=0)
    state_size: int = Field(default=0, ge=0)

    @property
    def gated_deltanet(self) -> bool:
        return self.value_heads > 0


class CompressedAttention(Frozen):
    """DeepSeek V4.1's attention, what the cost model needs beyond the head count and width:
    queries through a replicated q_lora_rank latent, one key/value latent of head_dim shared
    by every head (replicated, cached in a sliding window), a grouped low-rank output (o_a:
    head_dim -> o_lora_rank per head, o_b: o_lora_rank per group -> hidden, a rank reading the
    o_b columns of each group its heads touch). Which layers also hold a KV compressor and an
    indexer (both replicated) is per layer: ``LayerVariant.parts``."""

    q_lora_rank: int = Field(gt=0)
    o_groups: int = Field(gt=0)
    o_lora_rank: int = Field(gt=0)
    index_heads: int = Field(ge=0)
    index_head_dim: int = Field(ge=0)


class LayerVariant(Frozen):
    """Sizes some layers use instead of the model's. Gemma 4: global-attention layers have
    wider heads and may have fewer KV heads; KV-shared layers have no K/V of their own and a
    double-wide MLP. Step 3.5: sliding-window layers have more query heads over the same KV
    heads, and a rank holds the same fraction of them there (its query-head span scaled by
    ``num_heads / ModelSpec.num_heads``; the planner's head unit keeps that whole). A layer in
    several variants takes each in turn."""

    layers: tuple[int, ...]
    num_heads: int | None = Field(default=None, gt=0)
    head_dim: int | None = Field(default=None, gt=0)
    num_kv_heads: int | None = Field(default=None, gt=0)
    # FFN kind of these layers -> the ModelSpec.ffn_sizes kind holding its size (and its split)
    ffn: dict[str, str] = {}
    has_kv: bool = True  # False: the layer attends with an earlier layer's keys and values
    # Optional attention modules these layers hold (DeepSeek V4.1: "compressor",
    # "compressor_gate", "indexer", "index_keys"), and the tokens per compressed KV entry they
    # cache (0: none)
    parts: tuple[str, ...] = ()
    compress_ratio: int | None = Field(default=None, ge=0)


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
    # Routed experts working in a latent of this width (Kimi K3's routed_expert_hidden_size:
    # a replicated down projection into it before them, an up projection after); 0: none.
    moe_latent: int = Field(default=0, ge=0)
    # A norm of the routed experts' latent sum (latent_moe_use_norm): that sum is all-reduced
    # before it (ArchTable.sums), one more all-reduce per MoE layer.
    moe_latent_norm: bool = False
    # Attention residuals (Kimi K3's attn_res_block_size): each layer mixes earlier blocks'
    # outputs with two more hidden-size projections and norms (and the model once more).
    attention_residuals: bool = False
    compressed_attention: CompressedAttention | None = None
    # Residual streams per token mixed by hyper-connections around each sub-block (DeepSeek
    # V4.1; 0: a plain residual): their mixing weights are replicated on every rank.
    hc_mult: int = Field(default=0, ge=0)
    # Gemma 4 MoE: every layer runs a dense MLP ("ffn") beside its experts.
    dense_mlp_with_experts: bool = False
    # Columns of a second token-indexed table (Gemma 4's per-layer inputs, layers x width),
    # vocab-split like the embedding (0: none, or replicated when its vocabulary differs).
    per_layer_embedding: int = Field(default=0, ge=0)
    variants: tuple[LayerVariant, ...] = ()
    # False only in a layer's view (``layer``) of a layer reusing another layer's KV cache.
    has_kv: bool = True
    linear_attention: LinearAttention | None = None
    # True only in a layer's view of a linear-attention layer (no KV cache: recurrent state).
    recurrent: bool = False
    # A layer's view: its LayerVariant parts and compress ratio.
    parts: tuple[str, ...] = ()
    compress_ratio: int = 0
    # Nemotron-H's hybrid_override_pattern, one character per layer: each layer is one mixer,
    # M Mamba-2, * attention, - MLP, E MoE ("": every layer has attention and a feed-forward);
    # a layer's view holds its own character in ``block``.
    block_pattern: str = ""
    block: str = ""

    def layer(self, index: int) -> ModelSpec:
        """The sizes layer ``index`` uses (its variants applied; this spec when it has none)."""
        changes: dict[str, Any] = {}
        for v in self.variants:
            if index not in v.layers:
                continue
            if v.num_heads is not None:
                changes["num_heads"] = v.num_heads
            if v.head_dim is not None:
                changes["head_dim"] = v.head_dim
            if v.num_kv_heads is not None:
                changes["num_kv_heads"] = v.num_kv_heads
            if v.ffn:
                ffn = dict(changes.get("ffn_sizes", self.ffn_sizes))
                ffn.update({kind: self.ffn_sizes[src] for kind, src in v.ffn.items()})
                changes["ffn_sizes"] = ffn
            if not v.has_kv:
                changes["has_kv"] = False
            if v.parts:
                changes["parts"] = (*changes.get("parts", ()), *v.parts)
            if v.compress_ratio is not None:
                changes["compress_ratio"] = v.compress_ratio
        if self.linear_attention is not None and index in self.linear_attention.layers:
            changes["recurrent"] = True
        if self.block_pattern:
            changes["block"] = self.block_pattern[index]
        if not changes:
            return self
        return self.model_copy(update={**changes, "variants": ()})

    def layer_specs(self) -> list[ModelSpec]:
        """Every distinct layer view (the model's own first)."""
        views = [self]
        linear = self.linear_attention.layers if self.linear_attention else ()
        blocks = {self.block_pattern.index(b) for b in set(self.block_pattern)}
        for i in sorted({i for v in self.variants for i in v.layers} | set(linear) | blocks):
            view = self.layer(i)
            if view not in views:
                views.append(view)
        return views

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


def _ffn_sizes(c: dict[str, Any]) -> dict[str, int]:
    if c.get("intermediate_size_mlp"):  # mlx-lm's llama4_text: its MLP's width
        return {"ffn": int(c["intermediate_size_mlp"])}
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


# Step 3.5's names for the usual settings.
_ALIASES = {
    "num_attention_groups": "num_key_value_heads",
    "moe_num_experts": "n_routed_experts",
    "moe_top_k": "num_experts_per_tok",
    "share_expert_dim": "shared_expert_intermediate_size",
}


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


def _usual_names(c: dict[str, Any]) -> dict[str, Any]:
    out = {**{dst: c[src] for src, dst in _ALIASES.items() if src in c}, **c}
    if "moe_layers_enum" in c:  # Step 3.5: MoE layers listed, else every layer but the first
        enum = str(c["moe_layers_enum"] or "")
        moe = [int(i) for i in enum.split(",") if i.strip()]
        out["first_k_dense_replace"] = min(moe) if moe else 1
    return out


def _gated_deltanet(c: dict[str, Any]) -> LinearAttention:
    """Qwen 3.5 / Qwen3-Next: every layer but each full_attention_interval-th is Gated
    DeltaNet (mlx-lm decides by the interval alone)."""
    layers = int(c["num_hidden_layers"])
    interval = int(c.get("full_attention_interval") or 4)
    keys, values = int(c["linear_num_key_heads"]), int(c["linear_num_value_heads"])
    if values % keys:
        raise ExoTpError(f"{values} linear value heads are not a multiple of {keys} key heads")
    return LinearAttention(
        layers=tuple(i for i in range(layers) if (i + 1) % interval),
        num_heads=keys,
        head_dim=int(c["linear_key_head_dim"]),
        conv_kernel=int(c.get("linear_conv_kernel_dim") or 4),
        value_heads=values // keys,
        value_head_dim=int(c["linear_value_head_dim"]),
    )


def linear_head_widths(linear: LinearAttention) -> dict[str, int]:
    """The per-head widths the tables cut linear-attention weights by (ModelSpec.head_widths).

    KDA: a head's q, k, v rows (``linear_head_dim``) and one beta row. Gated DeltaNet, per key
    head (the split unit): q and k rows (``linear_head_dim``), its value heads' rows (v, z,
    out_proj's columns), one entry per value head (b, a, A_log, dt_bias), Qwen3-Next's
    interleaved q|k|v|z and b|a groups, and its conv channels (q, k and v). Mamba-2, per group:
    its heads' z and x rows, B and C rows, one dt per head, its conv channels (x, B, C). A
    short conv: one channel."""
    if linear.mamba2:
        x, n = linear.head_dim, linear.state_size
        heads = linear.heads_per_group
        return {
            "linear_head_dim": x,
            "mamba_state": n,
            "mamba_heads": heads,
            "mamba_conv": x + 2 * n,
        }
    if linear.short_conv:
        return {"linear_head_dim": 1}
    if not linear.gated_deltanet:
        return {"linear_head_dim": linear.head_dim, "linear_beta": 1}
    dk, r, dv = linear.head_dim, linear.value_heads, linear.value_head_dim
    return {
        "linear_head_dim": dk,
        "linear_value_width": r * dv,
        "linear_value_heads": r,
        "linear_qkvz_group": 2 * dk + 2 * r * dv,
        "linear_ba_group": 2 * r,
        "linear_conv_width": 2 * dk + r * dv,
    }


def _linear_attention(c: dict[str, Any]) -> LinearAttention | None:
    """Kimi K3's linear_attn_config (KDA heads and their 1-based layer numbers), or Gated
    DeltaNet's linear_* settings."""
    if c.get("linear_num_key_heads"):
        return _gated_deltanet(c)
    cfg = c.get("linear_attn_config")
    if not cfg:
        return None
    layers = int(c["num_hidden_layers"])
    return LinearAttention(
        layers=tuple(sorted(int(i) - 1 for i in cfg["kda_layers"] if 0 < int(i) <= layers)),
        num_heads=int(cfg["num_heads"]),
        head_dim=int(cfg["head_dim"]),
        conv_kernel=int(cfg.get("short_conv_kernel_size") or 4),
        full_rank_gate=bool(cfg.get("use_full_rank_gate", False)),
    )


def _other_attention(c: dict[str, Any], kv_heads: int) -> LayerVariant | None:
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
    return LayerVariant(layers=sliding, num_heads=heads)


# mlx-lm's gemma4_text.ModelArgs defaults for the keys read here, where config.json omits them.
_GEMMA4_DEFAULTS: dict[str, Any] = {
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
GEMMA4_TYPES = ("gemma4", "gemma4_text")


def _gemma4_text(config: dict[str, Any]) -> dict[str, Any]:
    c = {**_GEMMA4_DEFAULTS, **_text_config(config)}
    if config["model_type"] == "gemma4":  # mlx-lm's wrapper imposes its own vocab size
        c["vocab_size"] = config.get("vocab_size", 262144)
    if not c["enable_moe_block"]:  # experts settings mean nothing without the MoE block
        c = {k: v for k, v in c.items() if k not in ("num_experts", "moe_intermediate_size")}
    return c


def _gemma4_fields(c: dict[str, Any]) -> dict[str, Any]:
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
            LayerVariant(layers=shared, has_kv=False, ffn={"ffn": "ffn_wide"} if wide else {})
        )
    per_layer = int(c.get("hidden_size_per_layer_input") or 0)
    same_vocab = int(c["vocab_size_per_layer_input"]) == int(c["vocab_size"])
    return {
        "variants": tuple(variants),
        "extra_ffn": {"ffn_wide": 2 * int(c["intermediate_size"])} if wide else {},
        "per_layer_embedding": layers * per_layer if same_vocab else 0,
        "dense_mlp_with_experts": bool(c["enable_moe_block"]),
        "experts_per_token": int(c.get("top_k_experts") or 0),
    }


def _compressed_fields(c: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek V4.1: its attention's sizes, the layers holding a compressor (kv_source, with
    a gate where it pools several tokens) or an indexer (index_source, with key projections
    where it is a kv_source too) as variants, its hyper-connection streams, and its one shared
    expert (mlx-lm builds exactly one, of moe_intermediate_size, whatever config.json says)."""
    ratios = [int(r) for r in c.get("compress_ratios") or ()]
    kv, index = set(c.get("kv_source_layer_ids") or ()), set(c.get("index_source_layer_ids") or ())
    kinds: dict[tuple[tuple[str, ...], int], list[int]] = {}
    for i in range(int(c["num_hidden_layers"])):
        ratio = ratios[i] if i < len(ratios) else 0
        parts = [
            *(["compressor"] if i in kv else []),
            *(["compressor_gate"] if i in kv and ratio > 1 else []),
            *(["indexer"] if i in index else []),
            *(["index_keys"] if i in index and i in kv else []),
        ]
        cached = ratio if ratio and i in kv else 0  # the layers that add compressed entries
        if parts or cached:
            kinds.setdefault((tuple(parts), cached), []).append(i)
    variants = tuple(
        LayerVariant(layers=tuple(layers), parts=parts, compress_ratio=ratio)
        for (parts, ratio), layers in kinds.items()
    )
    attention = CompressedAttention(
        q_lora_rank=int(c.get("q_lora_rank", 1280)),
        o_groups=int(c.get("o_groups", 8)),
        o_lora_rank=int(c.get("o_lora_rank", 1024)),
        index_heads=int(c.get("index_n_heads", 32)),
        index_head_dim=int(c.get("index_head_dim", 128)),
    )
    return {
        "variants": variants,
        "compressed_attention": attention,
        "hc_mult": int(c.get("hc_mult", 4)),
        "extra_ffn": {"shared_expert_ffn": int(c["moe_intermediate_size"])},
    }


COMPRESSED_TYPES = ("deepseek_v41",)

# Nemotron-H's layer kinds by their names in layers_block_type / layer_types (mlx-lm's map).
_BLOCK_CHARS = {
    "full_attention": "*",
    "linear_attention": "M",
    "moe": "E",
    "mlp": "-",
    "attention": "*",
    "mamba": "M",
    "conv": "M",
}


def _nemotron_h_fields(c: dict[str, Any]) -> dict[str, Any]:
    """Nemotron-H: the layer pattern, its Mamba-2 layers split by groups (as LinearAttention,
    see its mamba2 fields) and the widths the table's rules cut them by; one shared expert of
    moe_shared_expert_intermediate_size (mlx-lm builds one whatever n_shared_experts says)."""
    pattern = c.get("hybrid_override_pattern")
    if pattern is None:
        kinds = c.get("layers_block_type") or c.get("layer_types") or ()
        unknown = sorted(set(kinds) - _BLOCK_CHARS.keys())
        if unknown or not kinds:
            raise ExoTpError(f"config.json: unknown or missing layer kinds {unknown}")
        pattern = [_BLOCK_CHARS[k] for k in kinds]
    pattern = "".join(pattern)
    heads, groups = int(c["mamba_num_heads"]), int(c["n_groups"])
    if heads % groups:
        raise ExoTpError(f"{heads} Mamba heads are not a multiple of {groups} groups")
    per_group, state, dim = heads // groups, int(c["ssm_state_size"]), int(c["mamba_head_dim"])
    linear = LinearAttention(
        layers=tuple(i for i, b in enumerate(pattern) if b == "M"),
        num_heads=groups,
        head_dim=per_group * dim,
        conv_kernel=int(c["conv_kernel"]),
        mamba2=True,
        heads_per_group=per_group,
        state_size=state,
    )
    shared = c.get("moe_shared_expert_intermediate_size") if c.get("n_shared_experts") else None
    return {
        "block_pattern": pattern,
        "num_hidden_layers": len(pattern),
        "linear_attention": linear,
        "head_widths": linear_head_widths(linear),
        "extra_ffn": {"shared_expert_ffn": int(shared)} if shared else {},
    }


NEMOTRON_H_TYPES = ("nemotron_h",)


def _lfm2_fields(c: dict[str, Any]) -> dict[str, Any]:
    """LFM2: its short-conv layers (all but full_attn_idxs / the full_attention layer types)
    split by channels, and its MLP's width as mlx-lm derives it (auto-adjusted: 2/3 of it,
    times the multiplier, rounded up to block_multiple_of)."""
    layers = int(c["num_hidden_layers"])
    full = c.get("full_attn_idxs")
    if full is None:
        full = [i for i, t in enumerate(c.get("layer_types") or ()) if t == "full_attention"]
    ff = int(c.get("block_ff_dim") or c["intermediate_size"])
    if c.get("block_auto_adjust_ff_dim"):
        ff = int(2 * ff / 3)
        if c.get("block_ffn_dim_multiplier") is not None:
            ff = int(float(c["block_ffn_dim_multiplier"]) * ff)
        multiple = int(c.get("block_multiple_of") or 1)
        ff = multiple * ((ff + multiple - 1) // multiple)
    linear = LinearAttention(
        layers=tuple(i for i in range(layers) if i not in set(full)),
        num_heads=int(c["hidden_size"]),
        head_dim=1,
        conv_kernel=int(c["conv_L_cache"]),
        short_conv=True,
    )
    return {
        "linear_attention": linear,
        "head_widths": linear_head_widths(linear),
        "extra_ffn": {"ffn": ff},
    }


LFM2_TYPES = ("lfm2",)


def spec_from_config(config: dict[str, Any]) -> ModelSpec:
    """The planner's view of a model; refuses an architecture without a table."""
    if "model_type" not in config:
        raise ExoTpError("config.json lacks 'model_type'")
    table = table_for(str(config["model_type"]))
    gemma4 = config["model_type"] in GEMMA4_TYPES
    c = _gemma4_text(config) if gemma4 else _usual_names(_text_config(config))
    if not table.split:
        c = _generic_names(c)
    if config["model_type"] == "llama4_text":  # mlx-lm's llama4_text is dense whatever it says
        c = {k: v for k, v in c.items() if k not in ("num_local_experts", "num_experts_per_tok")}
    try:
        extra = _gemma4_fields(c) if gemma4 else {}
        if config["model_type"] in COMPRESSED_TYPES:
            extra = _compressed_fields(c)
        if config["model_type"] in LFM2_TYPES:
            extra = _lfm2_fields(c)
        if config["model_type"] in NEMOTRON_H_TYPES:
            extra = _nemotron_h_fields(c)
            c = {**c, "num_hidden_layers": extra.pop("num_hidden_layers")}
        extra_ffn = extra.pop("extra_ffn", {})
        top_k = extra.pop("experts_per_token", 0)
        kv_heads, head_dim, head_widths = _heads(c, table.reads_head_dim)
        head_widths.update(extra.pop("head_widths", {}))
        other = _other_attention(c, kv_heads)
        if other is not None:
            extra["variants"] = (other,)
        if c.get("use_head_wise_attn_gate"):
            head_widths["head_gate"] = 1  # Step 3.5's g_proj: one gate row per query head
        linear = _linear_attention(c)
        if linear is not None:
            head_widths.update(linear_head_widths(linear))
            extra["linear_attention"] = linear
        if linear is not None and linear.gated_deltanet:
            # its full attention's q_proj: per head, the queries then their sigmoid gate
            head_widths["gated_q"] = 2 * head_dim
        spec = ModelSpec(
            model_type=str(config["model_type"]),
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
            num_experts=int(
                c.get("num_local_experts")
                or c.get("num_experts")
                or c.get("n_routed_experts")
                or c.get("moe_num_experts")
                or 0
            ),
            experts_per_token=int(
                c.get("num_experts_per_tok")
                or c.get("num_experts_per_token")  # Kimi K3
                or c.get("experts_per_token")
                or c.get("moe_k")
                or top_k
            ),
            dense_layers=_dense_layers(c),
            latent_attention=_latent_attention(str(config["model_type"]), c),
            moe_latent=int(c.get("routed_expert_hidden_size") or 0),
            moe_latent_norm=bool(
                c.get("routed_expert_hidden_size") and c.get("latent_moe_use_norm")
            ),
            attention_residuals=c.get("attn_res_block_size") is not None,
            **extra,
        )
    except KeyError as missing:
        raise ExoTpError(f"config.json lacks {missing.args[0]!r}") from None
    except (TypeError, ValueError) as bad:
        raise ExoTpError(f"config.json has an invalid value: {bad}") from None
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
