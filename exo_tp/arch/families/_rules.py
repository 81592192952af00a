"""Rule builders and rules several families' tables share (pure data)."""

from __future__ import annotations

from typing import Any

from exo_tp.arch.dims import Dim
from exo_tp.arch.table import BranchRule, CountRule, LinearRule, NormRule
from exo_tp.frozen import replace


def col(path: str, *parts: Dim, width: str = "head_dim") -> LinearRule:
    return LinearRule(path=path, style="column", parts=parts, width=width)


def row(path: str, *parts: Dim, width: str = "head_dim") -> LinearRule:
    return LinearRule(path=path, style="row", parts=parts, width=width)


def stacked(path: str) -> LinearRule:
    return LinearRule(path=path, style="stacked", parts=(Dim.Q_HEADS,))


def only_where(rule: LinearRule, where: str) -> LinearRule:
    """``rule`` applying only in blocks holding ``where`` (a module of one layer kind)."""
    return replace(rule, where=where)


def attention(prefix: str = "self_attn") -> tuple[LinearRule, ...]:
    """q/k/v column-parallel by heads (biases follow their rows), o row-parallel."""
    return (
        col(f"{prefix}.q_proj", Dim.Q_HEADS),
        col(f"{prefix}.k_proj", Dim.KV_HEADS),
        col(f"{prefix}.v_proj", Dim.KV_HEADS),
        row(f"{prefix}.o_proj", Dim.Q_HEADS),
    )


def glu(prefix: str, dim: Dim) -> tuple[LinearRule, ...]:
    """A gated MLP (dense or every expert of a stacked SwitchGLU): gate/up column, down row."""
    return (
        col(f"{prefix}.gate_proj", dim),
        col(f"{prefix}.up_proj", dim),
        row(f"{prefix}.down_proj", dim),
    )


ATTENTION = BranchRule(path="self_attn", kind="attention")
MLP = BranchRule(path="mlp", kind="mlp")
EXPERTS = BranchRule(path="mlp.switch_mlp", kind="experts", reduce=False)
HEAD_COUNTS = (
    CountRule(path="self_attn.n_heads", dim=Dim.Q_HEADS),
    CountRule(path="self_attn.n_kv_heads", dim=Dim.KV_HEADS),
)
# The same counts under the names of mlx-lm's newer ports.
ATTENTION_HEAD_COUNTS = (
    CountRule(path="self_attn.num_attention_heads", dim=Dim.Q_HEADS),
    CountRule(path="self_attn.num_key_value_heads", dim=Dim.KV_HEADS),
)
# qwen3/gemma3 normalise each head over head_dim: the same weights on every rank.
QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
# q_norm/k_norm normalise all heads together (width heads x head_dim): sharded norms, each
# rank's entries cut like its q/k rows, one all-reduce of the sums of squares per norm.
FULL_WIDTH_QK_NORMS = (
    NormRule(path="self_attn.q_norm", dim=Dim.Q_HEADS),
    NormRule(path="self_attn.k_norm", dim=Dim.KV_HEADS),
)

# A text model nested in a multimodal wrapper (mlx-lm drops the vision and audio towers):
# every path starts at language_model.
LANGUAGE_MODEL: dict[str, Any] = dict(
    layers="language_model.model.layers",
    embedding="language_model.model.embed_tokens",
    lm_head="language_model.lm_head",
    norm="language_model.model.norm",
)

# The DeepSeek-style MoE block: routed experts and the shared experts (one MLP of
# n_shared_experts * moe_intermediate_size) are each split by FFN rows and summed before the
# block's single all-reduce; the router (weights and, with sigmoid routing, its
# e_score_correction_bias) is replicated so every rank routes every token alike. Dense layers
# share the "mlp" path.
DEEPSEEK_MOE = (
    *glu("mlp", Dim.FFN),
    *glu("mlp.switch_mlp", Dim.EXPERT_FFN),
    *glu("mlp.shared_experts", Dim.SHARED_EXPERT_FFN),
)
DEEPSEEK_MOE_BRANCHES = (
    MLP,
    EXPERTS,
    BranchRule(path="mlp.shared_experts", kind="mlp", reduce=False),
)
