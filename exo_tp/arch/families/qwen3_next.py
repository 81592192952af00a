"""Gated DeltaNet hybrids: Qwen3-Next and Qwen 3.5 (dense and MoE)."""

from __future__ import annotations

from typing import Any

from exo_tp.arch.dims import Dim
from exo_tp.arch.families._rules import (
    ATTENTION,
    EXPERTS,
    LANGUAGE_MODEL,
    MLP,
    QK_NORMS,
    attention,
    col,
    glu,
    row,
)
from exo_tp.arch.family import Config, Family
from exo_tp.arch.model_spec import LinearAttention
from exo_tp.arch.table import ArchTable, BranchRule, CountRule, LinearRule
from exo_tp.errors import ExoTpError
from exo_tp.frozen import replace

# Their linear-attention layers (linear_attn) split by key heads (LINEAR_HEADS), each with
# the value heads grouped under it (mlx-lm repeats key head j for value heads j*r .. j*r+r-1,
# as GQA repeats a KV head): a rank keeps its key heads' q and k rows and their value heads' v
# and z rows, b and a rows, A_log and dt_bias entries and conv channels (the depthwise conv's
# groups follow the local channel count), so its recurrent state is its value heads'; out_proj
# is row-parallel (one all-reduce). The gated norm (one value_head_dim weight shared by every
# head) is replicated. A rank without key heads keeps the layer's ArraysCache in step
# (ZeroRecurrent). Every third-or-so layer is full attention as Qwen3's, with q_proj's rows
# per head the queries then their output gate (2 x head_dim per head, split with the head).
_LH = Dim.LINEAR_HEADS
_KEY, _VALUE = "linear_head_dim", "linear_value_width"
# q of every key head, k of every key head, then v of every value head: Qwen 3.5's in_proj_qkv
# and (both families) the conv's channels
_QKV: dict[str, Any] = dict(parts=(_LH, _LH, _LH), widths=(_KEY, _KEY, _VALUE))


def _gated_deltanet(packed: tuple[LinearRule, ...]) -> tuple[LinearRule, ...]:
    """The rules both families share, after their own input projections ``packed``."""
    per_value = "linear_value_heads"  # one entry per value head
    return (
        *packed,
        LinearRule(path="linear_attn.conv1d.weight", style="stacked", **_QKV),
        LinearRule(path="linear_attn.A_log", style="stacked", parts=(_LH,), width=per_value),
        LinearRule(path="linear_attn.dt_bias", style="stacked", parts=(_LH,), width=per_value),
        row("linear_attn.out_proj", _LH, width=_VALUE),
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
    CountRule(path="self_attn.num_attention_heads", dim=Dim.Q_HEADS, where="self_attn"),
    CountRule(path="self_attn.num_key_value_heads", dim=Dim.KV_HEADS, where="self_attn"),
)
# Full attention, dense MLPs and MoE blocks, the same in both families.
_QWEN_HYBRID_REST = (
    col("self_attn.q_proj", Dim.Q_HEADS, width="gated_q"),
    *attention()[1:],
    *glu("mlp", Dim.FFN),
    *glu("mlp.switch_mlp", Dim.EXPERT_FFN),
    *glu("mlp.shared_expert", Dim.SHARED_EXPERT_FFN),
)

# Qwen 3.5: q|k|v packed part by part (each part all heads), z, b and a apart.
_QWEN35_INPUTS = (
    LinearRule(path="linear_attn.in_proj_qkv", style="column", **_QKV),
    col("linear_attn.in_proj_z", _LH, width=_VALUE),
    col("linear_attn.in_proj_b", _LH, width="linear_value_heads"),
    col("linear_attn.in_proj_a", _LH, width="linear_value_heads"),
)
# Qwen3-Next: q|k|v|z interleaved per key head (its q, k, then its value heads' v and z), and
# b|a likewise: a key head's rows are one contiguous run, cut as one head of that width.
_QWEN3_NEXT_INPUTS = (
    col("linear_attn.in_proj_qkvz", _LH, width="linear_qkvz_group"),
    col("linear_attn.in_proj_ba", _LH, width="linear_ba_group"),
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
    **LANGUAGE_MODEL,
    stages=True,
)


def linear_attention(c: Config) -> LinearAttention | None:
    """Gated DeltaNet's layers from its linear_* settings: every layer but each
    full_attention_interval-th (mlx-lm decides by the interval alone); also mlx-lm's OLMo
    hybrid's, which has no table."""
    if not c.get("linear_num_key_heads"):
        return None
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


FAMILY = Family(tables=(QWEN3_NEXT, QWEN3_5), linear_attention=linear_attention)
