"""Kimi K3: Kimi Delta Attention (recurrent linear attention) beside MLA, a latent MoE,
attention residuals."""

from __future__ import annotations

from exo_tp.arch.dims import Dim
from exo_tp.arch.families._rules import (
    ATTENTION,
    DEEPSEEK_MOE,
    DEEPSEEK_MOE_BRANCHES,
    LANGUAGE_MODEL,
    col,
    only_where,
    row,
    stacked,
)
from exo_tp.arch.family import Config, Family
from exo_tp.arch.model_spec import LinearAttention
from exo_tp.arch.table import ArchTable, BranchRule, CountRule, LinearRule, Style, SumRule
from exo_tp.frozen import replace

# A linear-attention layer splits by its own heads (LINEAR_HEADS, ModelSpec.linear_attention)
# as attention does: each rank keeps its heads' rows of the packed q|k|v projection, of the
# decay (f_b) and output-gate (g_b, or the full-rank g_proj) projections and of the beta
# projection (one row per head), its heads' channels of the depthwise causal conv (whose groups
# follow the local channel count), its heads' A_log and dt_bias entries, and so its heads'
# recurrent state; o_proj is row-parallel (one all-reduce). The low-rank inputs of the decay and
# the gate (f_a, g_a) and the per-head output norm (one head_dim weight shared by all heads) are
# replicated. A rank holding none of its heads runs a stand-in that keeps the layer's cache in
# step (exo_tp.shard.layers.ZeroRecurrent).
_KDA = "self_attn.qkv_conv"  # a module only the linear-attention layers have
_KDA_PARTS = (Dim.LINEAR_HEADS,) * 3


def _delta_attention(p: str) -> tuple[LinearRule, ...]:
    def rule(path: str, style: Style, *parts: Dim, width: str | None) -> LinearRule:
        return LinearRule(path=f"{p}.{path}", style=style, parts=parts, width=width, where=_KDA)

    head, heads = "linear_head_dim", Dim.LINEAR_HEADS
    return (
        rule("qkv_proj", "column", *_KDA_PARTS, width=head),
        rule("qkv_conv.conv.weight", "stacked", *_KDA_PARTS, width=head),
        rule("f_b_proj", "column", heads, width=head),
        rule("g_b_proj", "column", heads, width=head),
        rule("g_proj", "column", heads, width=head),
        rule("b_proj", "column", heads, width="linear_beta"),
        rule("A_log", "stacked", heads, width=None),
        rule("dt_bias", "stacked", heads, width=head),
        rule("o_proj", "row", heads, width=head),
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
    **LANGUAGE_MODEL,
    linears=(
        *_delta_attention("self_attn"),
        col("self_attn.q_proj", Dim.Q_HEADS),
        col("self_attn.q_b_proj", Dim.Q_HEADS),
        stacked("self_attn.embed_q"),
        stacked("self_attn.unembed_out"),
        only_where(row("self_attn.o_proj", Dim.Q_HEADS, width="v_head_dim"), _MLA),
        only_where(col("self_attn.g_proj", Dim.Q_HEADS, width="v_head_dim"), _MLA),
        *DEEPSEEK_MOE,
    ),
    branches=(
        replace(ATTENTION, where=_MLA),
        BranchRule(path="self_attn", kind="recurrent", where=_KDA),
        *DEEPSEEK_MOE_BRANCHES,
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
        CountRule(path="self_attn.num_heads", dim=Dim.Q_HEADS, where=_MLA),
        CountRule(path="self_attn.num_heads", dim=Dim.LINEAR_HEADS, where=_KDA),
        CountRule(
            path="self_attn.projection_dim",
            dim=Dim.LINEAR_HEADS,
            width="linear_head_dim",
            where=_KDA,
        ),
        CountRule(
            path="self_attn.qkv_conv.conv.groups",
            dim=Dim.LINEAR_HEADS,
            width="linear_head_dim",
            times=3,
            where=_KDA,
        ),
    ),
    tie_default=False,
)


def linear_attention(c: Config) -> LinearAttention | None:
    """Kimi Delta Attention's layers from linear_attn_config (its heads and their 1-based layer
    numbers): Kimi K3's, and mlx-lm's Kimi Linear's (which has no table)."""
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


FAMILY = Family(tables=(KIMI_K3,), linear_attention=linear_attention)
