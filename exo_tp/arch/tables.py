"""One tensor-parallel table per supported mlx-lm architecture (family)."""

from __future__ import annotations

from typing import Literal

from exo_tp.arch.table import (
    ArchTable,
    BranchRule,
    CountRule,
    FusedBlock,
    GroupedOutputRule,
    LinearRule,
    NormRule,
    SumRule,
)
from exo_tp.frozen import replace

Style = Literal["column", "row", "stacked"]


def _col(path: str, *parts: str, width: str = "head_dim") -> LinearRule:
    return LinearRule(path=path, style="column", parts=parts, width=width)


def _row(path: str, *parts: str, width: str = "head_dim") -> LinearRule:
    return LinearRule(path=path, style="row", parts=parts, width=width)


def _stacked(path: str) -> LinearRule:
    return LinearRule(path=path, style="stacked", parts=("q_heads",))


def _attention(prefix: str = "self_attn") -> tuple[LinearRule, ...]:
    """q/k/v column-parallel by heads (biases follow their rows), o row-parallel."""
    return (
        _col(f"{prefix}.q_proj", "q_heads"),
        _col(f"{prefix}.k_proj", "kv_heads"),
        _col(f"{prefix}.v_proj", "kv_heads"),
        _row(f"{prefix}.o_proj", "q_heads"),
    )


def _glu(prefix: str, dim: str) -> tuple[LinearRule, ...]:
    """A gated MLP (dense or every expert of a stacked SwitchGLU): gate/up column, down row."""
    return (
        _col(f"{prefix}.gate_proj", dim),
        _col(f"{prefix}.up_proj", dim),
        _row(f"{prefix}.down_proj", dim),
    )


ATTENTION = BranchRule(path="self_attn", kind="attention")
MLP = BranchRule(path="mlp", kind="mlp")
HEAD_COUNTS = (
    CountRule(path="self_attn.n_heads", dim="q_heads"),
    CountRule(path="self_attn.n_kv_heads", dim="kv_heads"),
)
# qwen3/gemma3 normalise each head over head_dim: the same weights on every rank.
QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")

LLAMA_LIKE = ArchTable(
    model_types=("llama", "mistral", "qwen3"),
    linears=(*_attention(), *_glu("mlp", "ffn")),
    branches=(ATTENTION, MLP),
    replicated=QK_NORMS,
    counts=HEAD_COUNTS,
    stages=True,
    fused=FusedBlock(),
)

# Qwen2 (dense and MoE) derives head_dim as hidden_size // heads whatever config.json says.
QWEN2 = replace(LLAMA_LIKE, model_types=("qwen2",), reads_head_dim=False)

# Gemma 2/3: the same split; soft-capping of attention scores acts per head, soft-capping of
# the final logits acts on the gathered logits, the embedding scale after the embedding's
# all-reduce, and sliding-window layers keep a RotatingKVCache of the local heads.
GEMMA = ArchTable(
    model_types=("gemma3_text",),
    linears=(*_attention(), *_glu("mlp", "ffn")),
    branches=(ATTENTION, MLP),
    replicated=QK_NORMS,
    counts=(*HEAD_COUNTS, CountRule(path="self_attn.repeats", dim="repeats")),
)

# Gemma 2 computes its soft-capped scores per KV group (no fused attention): a batched mask
# needs the group axis.
GEMMA2 = replace(GEMMA, model_types=("gemma2",), grouped_scores=True)

# Phi-3 packs q|k|v and gate|up into one projection each: every packed part is split on its own.
PHI3 = ArchTable(
    model_types=("phi3",),
    linears=(
        _col("self_attn.qkv_proj", "q_heads", "kv_heads", "kv_heads"),
        _row("self_attn.o_proj", "q_heads"),
        _col("mlp.gate_up_proj", "ffn", "ffn"),
        _row("mlp.down_proj", "ffn"),
    ),
    branches=(ATTENTION, MLP),
    counts=HEAD_COUNTS,
    tie_default=False,
    reads_head_dim=False,
    stages=True,
)

# Mixture of experts: every expert's FFN is split alike (the experts stay stacked), the router
# is replicated, and the whole MoE block is one branch: one all-reduce after the weighted
# expert sum (and after adding the shared experts, where there are any).
MIXTRAL = ArchTable(
    model_types=("mixtral",),
    linears=(*_attention(), *_glu("block_sparse_moe.switch_mlp", "ffn")),
    branches=(ATTENTION, BranchRule(path="block_sparse_moe", kind="mlp")),
    replicated=("block_sparse_moe.gate",),
    counts=(
        CountRule(path="self_attn.num_heads", dim="q_heads"),
        CountRule(path="self_attn.num_key_value_heads", dim="kv_heads"),
    ),
    tie_default=False,
    reads_head_dim=False,
    stages=True,
)

EXPERTS = BranchRule(path="mlp.switch_mlp", kind="experts", reduce=False)

# Qwen3-MoE: dense layers ("mlp_only_layers") and MoE layers share the "mlp" path.
QWEN3_MOE = ArchTable(
    model_types=("qwen3_moe",),
    linears=(*_attention(), *_glu("mlp", "ffn"), *_glu("mlp.switch_mlp", "expert_ffn")),
    branches=(ATTENTION, MLP, EXPERTS),
    replicated=(*QK_NORMS, "mlp.gate"),
    counts=HEAD_COUNTS,
    stages=True,
)

# Qwen2-MoE: routed experts plus a sigmoid-gated shared expert, summed before the all-reduce.
QWEN2_MOE = ArchTable(
    model_types=("qwen2_moe",),
    linears=(
        *_attention(),
        *_glu("mlp.switch_mlp", "expert_ffn"),
        *_glu("mlp.shared_expert", "shared_expert_ffn"),
    ),
    branches=(
        ATTENTION,
        MLP,
        EXPERTS,
        BranchRule(path="mlp.shared_expert", kind="mlp", reduce=False),
    ),
    replicated=("mlp.gate", "mlp.shared_expert_gate"),
    counts=HEAD_COUNTS,
    tie_default=False,
    reads_head_dim=False,
    stages=True,
)

# DeepSeek V2/V3 (MLA): split by heads. Per-head projections (q or q_b, V2's kv_b, V3's
# embed_q/unembed_out stacks) follow the query heads, o_proj is row-parallel over heads of
# v_head_dim; the latent projections (q_a, kv_a) and their norms are replicated, so V3's latent
# KV cache is replicated on every rank (V2 caches per-head keys and values: split).
DEEPSEEK = ArchTable(
    model_types=("deepseek_v2", "deepseek_v3"),
    linears=(
        _col("self_attn.q_proj", "q_heads"),
        _col("self_attn.q_b_proj", "q_heads"),
        _col("self_attn.kv_b_proj", "q_heads", width="kv_b_head_dim"),
        _stacked("self_attn.embed_q"),
        _stacked("self_attn.unembed_out"),
        _row("self_attn.o_proj", "q_heads", width="v_head_dim"),
        *_glu("mlp", "ffn"),
        *_glu("mlp.switch_mlp", "expert_ffn"),
        *_glu("mlp.shared_experts", "shared_expert_ffn"),
    ),
    branches=(
        ATTENTION,
        MLP,
        EXPERTS,
        BranchRule(path="mlp.shared_experts", kind="mlp", reduce=False),
    ),
    replicated=(
        "self_attn.q_a_proj",
        "self_attn.q_a_layernorm",
        "self_attn.kv_a_proj_with_mqa",
        "self_attn.kv_a_layernorm",
        "mlp.gate",
    ),
    counts=(CountRule(path="self_attn.num_heads", dim="q_heads"),),
    tie_default=False,
    stages=True,
)

# gpt-oss: biased q/k/v/o, one attention sink per query head, biased experts.
GPT_OSS = ArchTable(
    model_types=("gpt_oss",),
    linears=(
        *_attention(),
        _stacked("self_attn.sinks"),
        *_glu("mlp.experts", "ffn"),
    ),
    branches=(ATTENTION, MLP),
    replicated=("mlp.router",),
    counts=(
        CountRule(path="self_attn.num_attention_heads", dim="q_heads"),
        CountRule(path="self_attn.num_key_value_heads", dim="kv_heads"),
        CountRule(path="self_attn.num_key_value_groups", dim="repeats"),
    ),
    tie_default=False,
    stages=True,
)

# ERNIE 4.5 MoE: llama attention; MoE layers (every moe_layer_interval-th from
# moe_layer_start_index) hold a softmax/sigmoid router (replicated: every rank must route alike),
# stacked routed experts and an ungated shared-expert MLP, summed before the one all-reduce.
ERNIE45_MOE = ArchTable(
    model_types=("ernie4_5_moe",),
    linears=(
        *_attention(),
        *_glu("mlp", "ffn"),
        *_glu("mlp.switch_mlp", "expert_ffn"),
        *_glu("mlp.shared_experts", "shared_expert_ffn"),
    ),
    branches=(
        ATTENTION,
        MLP,
        EXPERTS,
        BranchRule(path="mlp.shared_experts", kind="mlp", reduce=False),
    ),
    replicated=("mlp.gate",),
    counts=HEAD_COUNTS,
    stages=True,
)

# EXAONE MoE: the same split with per-head q/k norms (replicated) and a grouped sigmoid router
# (its weight and score-correction bias replicated); sliding-window layers keep a
# RotatingKVCache of the local heads, the global ones use no rope.
EXAONE_MOE = replace(
    ERNIE45_MOE, model_types=("exaone_moe",), replicated=(*QK_NORMS, "mlp.gate"), tie_default=False
)

# Ling / Bailing MoE: packed q|k|v ("query_key_value", split part by part as phi3's) and a
# row-parallel "dense" output under "attention"; per-head q/k norms replicated; grouped top-k
# router with its expert bias replicated; shared experts as an MLP inside the MoE branch. A
# normalised LM head (norm_head: sanitize divides each column by its norm over the whole
# vocabulary) is computed by mlx-lm's own load before the rows are cut.
BAILING_MOE = ArchTable(
    model_types=("bailing_moe",),
    linears=(
        _col("attention.query_key_value", "q_heads", "kv_heads", "kv_heads"),
        _row("attention.dense", "q_heads"),
        *_glu("mlp", "ffn"),
        *_glu("mlp.switch_mlp", "expert_ffn"),
        *_glu("mlp.shared_experts", "shared_expert_ffn"),
    ),
    branches=(
        BranchRule(path="attention", kind="attention"),
        MLP,
        EXPERTS,
        BranchRule(path="mlp.shared_experts", kind="mlp", reduce=False),
    ),
    replicated=("attention.query_layernorm", "attention.key_layernorm", "mlp.gate"),
    counts=(
        CountRule(path="attention.num_attention_heads", dim="q_heads"),
        CountRule(path="attention.num_key_value_heads", dim="kv_heads"),
    ),
    embedding="model.word_embeddings",
    tie_default=False,
    reads_head_dim=False,
    stages=True,
)

# ---------------------------------------------------------------------------------------------
# Families added with full-width q/k norms (exo_tp.shard.sharded_norm), per-layer head widths
# and KV sharing.
# ---------------------------------------------------------------------------------------------

# q_norm/k_norm normalise all heads together (width heads x head_dim): sharded norms, each
# rank's entries cut like its q/k rows, one all-reduce of the sums of squares per norm.
FULL_WIDTH_QK_NORMS = (
    NormRule(path="self_attn.q_norm", dim="q_heads"),
    NormRule(path="self_attn.k_norm", dim="kv_heads"),
)

# MiniMax (M1/M2): full-width q/k norms, partial rotary; every layer a MoE block with a
# sigmoid router and a score-correction bias (both replicated: every rank routes alike), the
# experts' FFN split like Mixtral's, one all-reduce after the weighted expert sum.
MINIMAX = ArchTable(
    model_types=("minimax",),
    linears=(*_attention(), *_glu("block_sparse_moe.switch_mlp", "ffn")),
    branches=(ATTENTION, BranchRule(path="block_sparse_moe", kind="mlp")),
    replicated=("block_sparse_moe.gate", "block_sparse_moe.e_score_correction_bias"),
    norms=FULL_WIDTH_QK_NORMS,
    counts=(
        CountRule(path="self_attn.num_attention_heads", dim="q_heads"),
        CountRule(path="self_attn.num_key_value_heads", dim="kv_heads"),
    ),
    tie_default=False,
    stages=True,
)

# OLMo 3: llama-like, with full-width q/k norms (sharded as MiniMax's), post-norms applied to
# each branch's all-reduced output, alternating sliding-window (RotatingKVCache of the local
# heads) and full-attention layers.
OLMO3 = ArchTable(
    model_types=("olmo3",),
    linears=(*_attention(), *_glu("mlp", "ffn")),
    branches=(ATTENTION, MLP),
    norms=FULL_WIDTH_QK_NORMS,
    counts=(
        CountRule(path="self_attn.num_attention_heads", dim="q_heads"),
        CountRule(path="self_attn.num_key_value_heads", dim="kv_heads"),
    ),
    tie_default=False,
    stages=True,
)

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
    linears=(*_attention(), *_glu("mlp", "ffn"), *_glu("experts.switch_glu", "expert_ffn")),
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
    layers="language_model.model.layers",
    embedding="language_model.model.embed_tokens",
    lm_head="language_model.lm_head",
    norm="language_model.model.norm",
    vocab_tables=("language_model.model.embed_tokens_per_layer",),
)

# ---------------------------------------------------------------------------------------------
# Llama-like families: the LLAMA_LIKE split (q/k/v by heads, o_proj and down_proj
# row-parallel, gate/up by FFN rows); layer norms and per-head q/k norms replicated.
# ---------------------------------------------------------------------------------------------

# SmolLM3: llama with rotary embeddings switched off in every no_rope_layer_interval-th layer
# (per layer, so any head split keeps it).
SMOLLM3 = replace(LLAMA_LIKE, model_types=("smollm3",))

# Seed-OSS: llama with optional q/k/v, o and MLP biases (row-parallel biases kept by one rank);
# its tied head multiplies by the embedding's weight directly, so the loader gives it a head
# through the vocab-parallel embedding (untie_attr).
SEED_OSS = ArchTable(
    model_types=("seed_oss",),
    linears=(*_attention(), *_glu("mlp", "ffn")),
    branches=(ATTENTION, MLP),
    counts=HEAD_COUNTS,
    untie_attr="tie_word_embeddings",
    stages=True,
)

# EXAONE 4: per-head q/k norms (replicated), post-norms on the reduced branch outputs,
# sliding-window layers with rotary embeddings and global layers without.
EXAONE4 = ArchTable(
    model_types=("exaone4",),
    linears=(*_attention(), *_glu("mlp", "ffn")),
    branches=(ATTENTION, MLP),
    replicated=QK_NORMS,
    counts=HEAD_COUNTS,
    stages=True,
)

# Ministral 3: llama-4 style position-dependent query scaling (computed alike on every rank)
# passed to the attention before the mask and cache (the stand-in finds the cache among the
# arguments), optional sliding layers.
MINISTRAL3 = ArchTable(
    model_types=("ministral3",),
    linears=(*_attention(), *_glu("mlp", "ffn")),
    branches=(ATTENTION, MLP),
    counts=HEAD_COUNTS,
    stages=True,
)

# ---------------------------------------------------------------------------------------------
# Llama 4 and Qwen3-VL text models.
# ---------------------------------------------------------------------------------------------

# mlx-lm's llama4_text: dense (feed_forward sized intermediate_size_mlp), weightless per-head
# q/k norms, no-rope layers; untied head named "output", tied head read from the embedding's
# weight (untie_attr, as Seed-OSS).
LLAMA4_TEXT = ArchTable(
    model_types=("llama4_text",),
    linears=(*_attention(), *_glu("feed_forward", "ffn")),
    branches=(ATTENTION, BranchRule(path="feed_forward", kind="mlp")),
    counts=HEAD_COUNTS,
    lm_head="output",
    untie_attr="tie_word_embeddings",
    stages=True,
)

# Qwen3-VL (dense and MoE) checkpoints, text prompts only: the Qwen3 / Qwen3-MoE text model
# under language_model (mlx-lm drops the vision tower; a text-only prompt's multimodal rotary
# positions are plain 1-D ones), split exactly as those.
_LANGUAGE_MODEL = dict(
    layers="language_model.model.layers",
    embedding="language_model.model.embed_tokens",
    lm_head="language_model.lm_head",
    norm="language_model.model.norm",
    stages=True,
)
# (not fused: its text model sits inside the multimodal wrapper, not tested with one pass)
QWEN3_VL = replace(LLAMA_LIKE, model_types=("qwen3_vl",), fused=None, **_LANGUAGE_MODEL)
QWEN3_VL_MOE = replace(QWEN3_MOE, model_types=("qwen3_vl_moe",), **_LANGUAGE_MODEL)

TABLES: tuple[ArchTable, ...] = (
    LLAMA_LIKE,
    QWEN2,
    GEMMA,
    GEMMA2,
    PHI3,
    MIXTRAL,
    QWEN3_MOE,
    QWEN2_MOE,
    DEEPSEEK,
    GPT_OSS,
    ERNIE45_MOE,
    EXAONE_MOE,
    BAILING_MOE,
    MINIMAX,
    OLMO3,
    GEMMA4_TEXT,
    GEMMA4,
    SMOLLM3,
    SEED_OSS,
    EXAONE4,
    MINISTRAL3,
    LLAMA4_TEXT,
    QWEN3_VL,
    QWEN3_VL_MOE,
)


# --- GLM-4 MoE, GLM-4.7-Flash (glm4_moe_lite), Mistral 4, Kimi K2.5, DeepSeek Sparse Attention ---

# The DeepSeek-style MoE block: routed experts and the shared experts (one MLP of
# n_shared_experts * moe_intermediate_size) are each split by FFN rows and summed before the
# block's single all-reduce; the router (weights and, with sigmoid routing, its
# e_score_correction_bias) is replicated so every rank routes every token alike.
_DEEPSEEK_MOE = (
    *_glu("mlp", "ffn"),
    *_glu("mlp.switch_mlp", "expert_ffn"),
    *_glu("mlp.shared_experts", "shared_expert_ffn"),
)
_DEEPSEEK_MOE_BRANCHES = (
    MLP,
    EXPERTS,
    BranchRule(path="mlp.shared_experts", kind="mlp", reduce=False),
)

# GLM-4.5/4.6 (glm4_moe): GQA attention like Llama (q/k/v column-parallel by heads with their
# biases, o row-parallel); the per-head q/k norms and the partial rotary embedding act within
# each head, so they need nothing but the local head counts. Dense first layers
# (first_k_dense_replace) share the "mlp" path with the MoE layers.
GLM4_MOE = ArchTable(
    model_types=("glm4_moe",),
    linears=(*_attention(), *_DEEPSEEK_MOE),
    branches=(ATTENTION, *_DEEPSEEK_MOE_BRANCHES),
    replicated=(*QK_NORMS, "mlp.gate"),
    counts=HEAD_COUNTS,
    tie_default=False,
    stages=True,
)

# glm4_moe_lite (GLM-4.7-Flash) is DeepSeek V3's MLA and MoE under other class names: the same
# split (per-head q_b/embed_q/unembed_out, o row-parallel over v_head_dim, latent projections and
# the latent KV cache replicated).
GLM4_MOE_LITE = replace(DEEPSEEK, model_types=("glm4_moe_lite",))

# Mistral 4: DeepSeek V3's MLA (latent cache replicated, heads split) with a softmax router that
# is a plain Linear ("mlp.gate", replicated); its attention takes the llama-4 query scale as a
# second argument (the zero stand-in finds the cache among the arguments).
MISTRAL4 = replace(DEEPSEEK, model_types=("mistral4",))

# Kimi K2 (and K2 Thinking): DeepSeek V3 under another model type (mlx-lm remaps it).
KIMI_K2 = replace(DEEPSEEK, model_types=("kimi_k2",))

# Kimi K2.5: a DeepSeek V3 text model nested in a multimodal wrapper (the vision tower is
# dropped by mlx-lm's sanitize), so every path starts at language_model.
KIMI_K25 = replace(
    DEEPSEEK,
    model_types=("kimi_k25",),
    layers="language_model.model.layers",
    embedding="language_model.model.embed_tokens",
    lm_head="language_model.lm_head",
    norm="language_model.model.norm",
)

# DeepSeek V3.2 and GLM-5 (glm_moe_dsa): DeepSeek V3's MLA and MoE plus DeepSeek Sparse
# Attention's indexer, which picks the top index_topk keys per query from its own small
# projections (wq_b over the replicated q_a latent, wk, k_norm, weights_proj). The indexer is
# replicated, not split: every rank needs the same full selection for its heads, and a split
# indexer would have to all-reduce a (queries x keys) score tensor per layer and could then pick
# different keys than one device does (a sum in another order can reorder near-ties). Replicated,
# each rank computes exactly the single-device selection, with no extra collective; it costs
# every rank the indexer's weights (small next to the experts) and its key cache (one
# index_head_dim vector per token, the second cache of each layer's CacheList).
DEEPSEEK_DSA = replace(
    DEEPSEEK,
    model_types=("deepseek_v32", "glm_moe_dsa"),
    replicated=(*DEEPSEEK.replicated, "self_attn.indexer"),
)

# Step 3.5: GQA attention as Llama with per-head q/k norms (replicated) and a head-wise
# sigmoid gate (g_proj: one row per query head, split with its heads); its sliding-window layers
# have more query heads than the others (96 against 64, the same 8 KV heads): a rank holds the
# same fraction of heads in every layer (a LayerVariant of ModelSpec). Dense first layers; MoE
# layers route with a replicated sigmoid router (gate Linear + router_bias) over stacked experts
# and add a shared expert (share_expert), both split by FFN rows; one all-reduce per MoE block.
STEP3P5 = ArchTable(
    model_types=("step3p5",),
    linears=(
        *_attention(),
        _col("self_attn.g_proj", "q_heads", width="head_gate"),
        *_glu("mlp", "ffn"),
        *_glu("mlp.switch_mlp", "expert_ffn"),
        *_glu("mlp.share_expert", "shared_expert_ffn"),
    ),
    branches=(
        ATTENTION,
        MLP,
        EXPERTS,
        BranchRule(path="mlp.share_expert", kind="mlp", reduce=False),
    ),
    replicated=(*QK_NORMS, "mlp.gate"),
    counts=(
        CountRule(path="self_attn.num_heads", dim="q_heads"),
        CountRule(path="self_attn.num_kv_heads", dim="kv_heads"),
    ),
    tie_default=False,
    stages=True,
)

# DeepSeek V4.1: queries through a replicated q_a latent and per-head q_b rows (split with their
# heads, as are the per-head attention sinks), one key/value latent shared by every head (MQA:
# kv_proj, its norm and its window cache replicated, like MLA's latent), the KV compressor and
# the DSA-style indexer replicated for the reasons DEEPSEEK_DSA gives (every rank needs the
# single-device top-k selection, and later layers read the compressed KV, index keys and
# selections a source layer leaves in the forward pass's shared state); the grouped low-rank
# output (o_a per group of heads, o_b over the groups) split by heads (GroupedOutputRule). The
# MoE block: a replicated sqrt-softplus router, routed experts under experts.switch_mlp and one
# shared expert, split by rows, one all-reduce. The hyper-connection mixers (attn_hc, ffn_hc)
# and the layer norms act on the full residual streams outside the branches: replicated.
# Its caches cannot be batched by mlx-lm: batches run one sequence at a time. Pipeline stages
# hand on its streams and shared state in one message per step (exo_tp.shard.streams).
DEEPSEEK_V41 = ArchTable(
    model_types=("deepseek_v41",),
    linears=(
        _col("self_attn.q_b_proj", "q_heads"),
        _stacked("self_attn.sinks"),
        *_glu("mlp.experts.switch_mlp", "expert_ffn"),
        *_glu("mlp.shared_experts", "shared_expert_ffn"),
    ),
    branches=(
        ATTENTION,
        MLP,
        BranchRule(path="mlp.experts.switch_mlp", kind="experts", reduce=False),
        BranchRule(path="mlp.shared_experts", kind="mlp", reduce=False),
    ),
    replicated=(
        "self_attn.q_a_proj",
        "self_attn.q_a_norm",
        "self_attn.kv_proj",
        "self_attn.kv_norm",
        "self_attn.compressor",
        "self_attn.indexer",
        "mlp.gate",
    ),
    grouped_outputs=(
        GroupedOutputRule(
            inner="self_attn.o_a_proj",
            outer="self_attn.o_b_proj",
            groups="self_attn.o_groups",
            ids="self_attn._group_ids",
        ),
    ),
    counts=(CountRule(path="self_attn.num_heads", dim="q_heads"),),
    tie_default=False,
    batch_by_sequence=True,
    stages=True,
    stage_state=True,
)

TABLES += (
    GLM4_MOE,
    GLM4_MOE_LITE,
    MISTRAL4,
    KIMI_K2,
    KIMI_K25,
    DEEPSEEK_DSA,
    STEP3P5,
    DEEPSEEK_V41,
)

# --- Kimi K3: Kimi Delta Attention (recurrent linear attention) beside MLA ---

# A linear-attention layer splits by its own heads ("linear_heads", ModelSpec.linear_attention)
# as attention does: each rank keeps its heads' rows of the packed q|k|v projection, of the
# decay (f_b) and output-gate (g_b, or the full-rank g_proj) projections and of the beta
# projection (one row per head), its heads' channels of the depthwise causal conv (whose groups
# follow the local channel count), its heads' A_log and dt_bias entries, and so its heads'
# recurrent state; o_proj is row-parallel (one all-reduce). The low-rank inputs of the decay and
# the gate (f_a, g_a) and the per-head output norm (one head_dim weight shared by all heads) are
# replicated. A rank holding none of its heads runs a stand-in that keeps the layer's cache in
# step (exo_tp.shard.layers.ZeroRecurrent).
_KDA = "self_attn.qkv_conv"  # a module only the linear-attention layers have
_KDA_PARTS = ("linear_heads", "linear_heads", "linear_heads")


def _delta_attention(p: str) -> tuple[LinearRule, ...]:
    def rule(path: str, style: Style, *parts: str, width: str | None) -> LinearRule:
        return LinearRule(path=f"{p}.{path}", style=style, parts=parts, width=width, where=_KDA)

    head = "linear_head_dim"
    return (
        rule("qkv_proj", "column", *_KDA_PARTS, width=head),
        rule("qkv_conv.conv.weight", "stacked", *_KDA_PARTS, width=head),
        rule("f_b_proj", "column", "linear_heads", width=head),
        rule("g_b_proj", "column", "linear_heads", width=head),
        rule("g_proj", "column", "linear_heads", width=head),
        rule("b_proj", "column", "linear_heads", width="linear_beta"),
        rule("A_log", "stacked", "linear_heads", width=None),
        rule("dt_bias", "stacked", "linear_heads", width=head),
        rule("o_proj", "row", "linear_heads", width=head),
    )


# The MLA layers are DeepSeek V3's (per-head q/q_b, embed_q/unembed_out stacks, o_proj over
# v_head_dim, latents replicated) with an optional sigmoid output gate (g_proj, v_head_dim rows
# per head); their o_proj and g_proj share names with the linear-attention layer's, so they
# apply where the MLA's latent projection is.
_MLA = "self_attn.kv_a_proj_with_mqa"

# Kimi K3: Kimi Delta Attention layers (linear_attn_config.kda_layers) and MLA layers, dense then
# DeepSeek-style MoE layers (router and its score correction replicated; routed experts and
# shared experts by rows, one all-reduce per block; a latent MoE's down/up projections around
# the experts replicated: linear, so the up projection of each rank's partial latent sum adds up
# to that of the whole, unless a norm of the routed sum sits between them: then that sum is
# all-reduced before it, one more per MoE layer), attention residuals (the layers' res
# projections and norms act on reduced hidden states: replicated), all under language_model.
# One stage only: the attention residuals carry every earlier block's output from layer to
# layer, which a later stage would need handed over with the hidden state (docs/planner.md).
KIMI_K3 = ArchTable(
    model_types=("kimi_k3",),
    layers="language_model.model.layers",
    embedding="language_model.model.embed_tokens",
    lm_head="language_model.lm_head",
    norm="language_model.model.norm",
    linears=(
        *_delta_attention("self_attn"),
        _col("self_attn.q_proj", "q_heads"),
        _col("self_attn.q_b_proj", "q_heads"),
        _stacked("self_attn.embed_q"),
        _stacked("self_attn.unembed_out"),
        replace(_row("self_attn.o_proj", "q_heads", width="v_head_dim"), where=_MLA),
        replace(_col("self_attn.g_proj", "q_heads", width="v_head_dim"), where=_MLA),
        *_DEEPSEEK_MOE,
    ),
    branches=(
        replace(ATTENTION, where=_MLA),
        BranchRule(path="self_attn", kind="recurrent", where=_KDA),
        *_DEEPSEEK_MOE_BRANCHES,
    ),
    replicated=(
        "self_attn.f_a_proj",
        "self_attn.g_a_proj",
        "self_attn.o_norm",
        "self_attn.q_a_proj",
        "self_attn.q_a_layernorm",
        _MLA,
        "self_attn.kv_a_layernorm",
        "mlp.gate",
        "mlp.e_score_correction_bias",
        "mlp.routed_expert_down_proj",
        "mlp.routed_expert_norm",
        "mlp.routed_expert_up_proj",
    ),
    # a latent MoE's norm of the routed sum (latent_moe_use_norm) needs the whole sum: its
    # input is all-reduced first, and the up projection after it counted once
    sums=(
        SumRule(
            path="mlp.routed_expert_norm", width="moe_latent", once="mlp.routed_expert_up_proj"
        ),
    ),
    counts=(
        CountRule(path="self_attn.num_heads", dim="q_heads", where=_MLA),
        CountRule(path="self_attn.num_heads", dim="linear_heads", where=_KDA),
        CountRule(
            path="self_attn.projection_dim", dim="linear_heads", width="linear_head_dim", where=_KDA
        ),
        CountRule(
            path="self_attn.qkv_conv.conv.groups",
            dim="linear_heads",
            width="linear_head_dim",
            times=3,
            where=_KDA,
        ),
    ),
    tie_default=False,
)

TABLES += (KIMI_K3,)

# --- Nemotron-H: Mamba-2, attention, MLP and MoE layers by a pattern (hybrid_override_pattern) ---

# Every layer is one `mixer` of one kind (M Mamba-2, * attention, - MLP, E MoE), so each rule
# applies `where` its kind's own module is. A Mamba-2 layer splits by its groups
# ("linear_heads" counts groups here, ModelSpec.linear_attention): B and C belong to a group
# (shared by its heads) and the gated RMSNorm normalises each group's heads together, so a
# group with its heads is the unit that keeps both local (a split inside a group would need
# B and C per head and an all-reduce per norm group). Each rank keeps its groups' rows of the
# packed in_proj (z and x: heads_per_group x head_dim per group, B and C: state_size per group,
# dt: heads_per_group per group), its groups' conv channels (x, B, C; the depthwise conv's
# groups follow the local channel count), A_log, D and dt_bias of its heads, its groups' norm
# weights, and so their conv and SSM state; out_proj is row-parallel (one all-reduce). With
# more ranks than groups some hold none (ZeroRecurrent keeps their cache in step).
_MAMBA = "mixer.in_proj"  # modules only each kind has
_ATTN = "mixer.q_proj"
_DENSE = "mixer.up_proj"
_MOE = "mixer.switch_mlp"
_G = "linear_heads"


def _mamba2() -> tuple[LinearRule, ...]:
    def rule(path: str, style: Style, *widths: str) -> LinearRule:
        parts = (_G,) * len(widths)
        return LinearRule(
            path=f"mixer.{path}", style=style, parts=parts, widths=widths, where=_MAMBA
        )

    x, state, heads = "linear_head_dim", "mamba_state", "mamba_heads"
    return (
        rule("in_proj", "column", x, x, state, state, heads),  # z | x | B | C | dt
        rule("conv1d.weight", "stacked", x, state, state),  # channels x | B | C
        rule("conv1d.bias", "stacked", x, state, state),
        rule("A_log", "stacked", heads),
        rule("D", "stacked", heads),
        rule("dt_bias", "stacked", heads),
        rule("norm.weight", "stacked", x),
        rule("out_proj", "row", x),
    )


def _where(rule: LinearRule, where: str) -> LinearRule:
    return replace(rule, where=where)


NEMOTRON_H = ArchTable(
    model_types=("nemotron_h",),
    layers="backbone.layers",
    embedding="backbone.embeddings",
    norm="backbone.norm_f",
    linears=(
        *_mamba2(),
        *(_where(r, _ATTN) for r in _attention("mixer")),
        _where(_col("mixer.up_proj", "ffn"), _DENSE),
        _where(_row("mixer.down_proj", "ffn"), _DENSE),
        _where(_col("mixer.switch_mlp.fc1", "expert_ffn"), _MOE),
        _where(_row("mixer.switch_mlp.fc2", "expert_ffn"), _MOE),
        _where(_col("mixer.shared_experts.up_proj", "shared_expert_ffn"), _MOE),
        _where(_row("mixer.shared_experts.down_proj", "shared_expert_ffn"), _MOE),
    ),
    branches=(
        BranchRule(path="mixer", kind="recurrent", where=_MAMBA),
        BranchRule(path="mixer", kind="attention", where=_ATTN),
        BranchRule(path="mixer", kind="mlp", where=_DENSE),
        BranchRule(path="mixer", kind="mlp", where=_MOE),
        BranchRule(path="mixer.switch_mlp", kind="experts", reduce=False, where=_MOE),
        BranchRule(path="mixer.shared_experts", kind="mlp", reduce=False, where=_MOE),
    ),
    # the sigmoid router and its score correction: every rank routes every token alike. A
    # latent MoE's projections (moe_latent_size) are not declared: the loader refuses them.
    replicated=("mixer.gate",),
    counts=(
        CountRule(path="mixer.num_heads", dim=_G, width="mamba_heads", where=_MAMBA),
        CountRule(path="mixer.n_groups", dim=_G, where=_MAMBA),
        CountRule(path="mixer.intermediate_size", dim=_G, width="linear_head_dim", where=_MAMBA),
        CountRule(path="mixer.conv_dim", dim=_G, width="mamba_conv", where=_MAMBA),
        CountRule(path="mixer.conv1d.groups", dim=_G, width="mamba_conv", where=_MAMBA),
        CountRule(path="mixer.num_heads", dim="q_heads", where=_ATTN),
        CountRule(path="mixer.num_key_value_heads", dim="kv_heads", where=_ATTN),
    ),
    tie_default=False,
    # a stage's mask indices follow its slice (exo_tp.shard.apply._first_cached)
    stages=True,
)

TABLES += (NEMOTRON_H,)


# --- LFM2: short convolutions beside attention ---

# A short-conv layer (every layer but full_attn_idxs) splits by channels ("linear_heads"
# counts channels, one wide, ModelSpec.linear_attention): its in_proj's B, C and x rows of the
# rank's channels (B * x and C * conv act channel by channel), their depthwise conv taps (groups
# follow the local channel count) and so their conv state; out_proj row-parallel (one
# all-reduce). The unit grows to the quantization group (out_proj's column cut). The conv reads
# its channel count from the model's shared ModelArgs: each block gets its own copy. Attention
# as llama's with per-head q/k layernorms replicated; the SwiGLU MLP w1/w3 column, w2 row.
_CONV = "conv.in_proj"


def _short_conv() -> tuple[LinearRule, ...]:
    def rule(path: str, style: Style, parts: int) -> LinearRule:
        return LinearRule(
            path=f"conv.{path}", style=style, parts=(_G,) * parts, width="linear_head_dim"
        )

    return (
        rule("in_proj", "column", 3),  # B | C | x
        rule("conv.weight", "stacked", 1),
        rule("conv.bias", "stacked", 1),
        rule("out_proj", "row", 1),
    )


LFM2 = ArchTable(
    model_types=("lfm2",),
    norm="model.embedding_norm",
    linears=(
        *_short_conv(),
        _col("self_attn.q_proj", "q_heads"),
        _col("self_attn.k_proj", "kv_heads"),
        _col("self_attn.v_proj", "kv_heads"),
        _row("self_attn.out_proj", "q_heads"),
        *(
            LinearRule(path=f"feed_forward.{p}", style=s, parts=("ffn",))
            for p, s in (("w1", "column"), ("w3", "column"), ("w2", "row"))
        ),
    ),
    branches=(
        BranchRule(path="conv", kind="recurrent"),
        ATTENTION,
        BranchRule(path="feed_forward", kind="mlp"),
    ),
    replicated=("self_attn.q_layernorm", "self_attn.k_layernorm"),
    copied=("conv.args",),
    counts=(
        CountRule(path="conv.conv.groups", dim=_G, width="linear_head_dim", where=_CONV),
        CountRule(path="conv.args.hidden_size", dim=_G, width="linear_head_dim", where=_CONV),
        CountRule(path="self_attn.n_heads", dim="q_heads", where="self_attn"),
        CountRule(path="self_attn.n_kv_heads", dim="kv_heads", where="self_attn"),
    ),
    reads_head_dim=False,
    # a stage's first attention / conv layer follows its slice (exo_tp.shard.apply)
    stages=True,
)

TABLES += (LFM2,)

# --- Gated DeltaNet hybrids: Qwen 3.5 (dense and MoE) and Qwen3-Next ---

# Their linear-attention layers (linear_attn) split by key heads ("linear_heads"), each with
# the value heads grouped under it (mlx-lm repeats key head j for value heads j*r .. j*r+r-1,
# as GQA repeats a KV head): a rank keeps its key heads' q and k rows and their value heads' v
# and z rows, b and a rows, A_log and dt_bias entries and conv channels (the depthwise conv's
# groups follow the local channel count), so its recurrent state is its value heads'; out_proj
# is row-parallel (one all-reduce). The gated norm (one value_head_dim weight shared by every
# head) is replicated. A rank without key heads keeps the layer's ArraysCache in step
# (ZeroRecurrent). Every third-or-so layer is full attention as Qwen3's, with q_proj's rows
# per head the queries then their output gate (2 x head_dim per head, split with the head).
_LH = "linear_heads"
_KEY, _VALUE = "linear_head_dim", "linear_value_width"
# q of every key head, k of every key head, then v of every value head: Qwen 3.5's in_proj_qkv
# and (both families) the conv's channels
_QKV = dict(parts=(_LH, _LH, _LH), widths=(_KEY, _KEY, _VALUE))


def _gated_deltanet(packed: tuple[LinearRule, ...]) -> tuple[LinearRule, ...]:
    """The rules both families share, after their own input projections ``packed``."""
    per_value = "linear_value_heads"  # one entry per value head
    return (
        *packed,
        LinearRule(path="linear_attn.conv1d.weight", style="stacked", **_QKV),
        LinearRule(path="linear_attn.A_log", style="stacked", parts=(_LH,), width=per_value),
        LinearRule(path="linear_attn.dt_bias", style="stacked", parts=(_LH,), width=per_value),
        _row("linear_attn.out_proj", _LH, width=_VALUE),
    )


# Each layer holds one of the two kinds: a count applies where its module is.
_GDN_COUNTS = tuple(
    CountRule(path=f"linear_attn.{name}", dim=_LH, width=width, where="linear_attn")
    for name, width in (
        ("num_k_heads", None),
        ("num_v_heads", "linear_value_heads"),
        ("key_dim", _KEY),
        ("value_dim", _VALUE),
        ("conv_dim", "linear_conv_width"),
        ("conv1d.groups", "linear_conv_width"),
    )
) + (
    CountRule(path="self_attn.num_attention_heads", dim="q_heads", where="self_attn"),
    CountRule(path="self_attn.num_key_value_heads", dim="kv_heads", where="self_attn"),
)
# Full attention, dense MLPs and MoE blocks, the same in both families.
_QWEN_HYBRID_REST = (
    _col("self_attn.q_proj", "q_heads", width="gated_q"),
    *_attention()[1:],
    *_glu("mlp", "ffn"),
    *_glu("mlp.switch_mlp", "expert_ffn"),
    *_glu("mlp.shared_expert", "shared_expert_ffn"),
)

# Qwen 3.5: q|k|v packed part by part (each part all heads), z, b and a apart.
_QWEN35_INPUTS = (
    LinearRule(path="linear_attn.in_proj_qkv", style="column", **_QKV),
    _col("linear_attn.in_proj_z", _LH, width=_VALUE),
    _col("linear_attn.in_proj_b", _LH, width="linear_value_heads"),
    _col("linear_attn.in_proj_a", _LH, width="linear_value_heads"),
)
# Qwen3-Next: q|k|v|z interleaved per key head (its q, k, then its value heads' v and z), and
# b|a likewise: a key head's rows are one contiguous run, cut as one head of that width.
_QWEN3_NEXT_INPUTS = (
    _col("linear_attn.in_proj_qkvz", _LH, width="linear_qkvz_group"),
    _col("linear_attn.in_proj_ba", _LH, width="linear_ba_group"),
)

# MoE layers as qwen2_moe (router and shared-expert gate replicated, routed experts and the
# shared expert by rows, one all-reduce); dense layers (Qwen 3.5 dense, Qwen3-Next's
# mlp_only_layers) as llama's MLP.
QWEN3_NEXT = ArchTable(
    model_types=("qwen3_next",),
    linears=(*_gated_deltanet(_QWEN3_NEXT_INPUTS), *_QWEN_HYBRID_REST),
    branches=(
        ATTENTION,
        BranchRule(path="linear_attn", kind="recurrent"),
        MLP,
        EXPERTS,
        BranchRule(path="mlp.shared_expert", kind="mlp", reduce=False),
    ),
    replicated=(*QK_NORMS, "linear_attn.norm", "mlp.gate", "mlp.shared_expert_gate"),
    counts=_GDN_COUNTS,
    tie_default=False,
    stages=True,
)

# Qwen 3.5 (dense and MoE checkpoints share mlx-lm's class): the text model under
# language_model; text prompts only (mlx-lm drops the vision tower).
QWEN3_5 = replace(
    QWEN3_NEXT,
    model_types=("qwen3_5", "qwen3_5_moe"),
    linears=(*_gated_deltanet(_QWEN35_INPUTS), *_QWEN_HYBRID_REST),
    **_LANGUAGE_MODEL,
)

TABLES += (QWEN3_NEXT, QWEN3_5)
