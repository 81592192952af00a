"""The sizes of a model the planner works with (pure data, no MLX).

exo_tp.plan.spec reads config.json into a ModelSpec; a family's config reader
(exo_tp.arch.families) builds the parts only its layers have (layer variants, linear
attention, compressed attention), so they live here, below both.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from exo_tp.arch.dims import FfnDim
from exo_tp.errors import ExoTpError
from exo_tp.frozen import Frozen


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
    ffn: dict[FfnDim, FfnDim] = {}
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
    # Width of each feed-forward kind that gets split: {FFN: 1536}, MoE adds EXPERT_FFN, ...
    ffn_sizes: dict[FfnDim, int]
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
    # A vision checkpoint's tower and projector, as stored (0: none): held whole by one rank
    # beside its shard (exo_tp.plan.vision).
    vision_bytes: int = Field(default=0, ge=0)
    # The checkpoint's MTP heads, as stored (0: none): held whole by every rank of the last
    # stage beside its shard (exo_tp.plan.mtp).
    mtp_bytes: int = Field(default=0, ge=0)
    # Patches its tower runs for one image at the checkpoint's own image size (its compute in
    # a prompt's time: Prediction.tower_seconds).
    vision_patches: int = Field(default=0, ge=0)
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
