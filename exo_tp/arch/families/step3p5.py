"""Step 3.5: GQA with a head-wise gate, more query heads in its sliding-window layers."""

from __future__ import annotations

from exo_tp.arch.dims import Dim
from exo_tp.arch.families._rules import (
    ATTENTION,
    EXPERTS,
    MLP,
    QK_NORMS,
    attention,
    col,
    glu,
)
from exo_tp.arch.family import Config, Family, SpecFields, text_config
from exo_tp.arch.model_spec import LayerVariant
from exo_tp.arch.table import ArchTable, BranchRule, CountRule
from exo_tp.errors import ExoTpError

# Step 3.5: GQA attention as Llama with per-head q/k norms (replicated) and a head-wise
# sigmoid gate (g_proj: one row per query head, split with its heads); its sliding-window layers
# have more query heads than the others (96 against 64, the same 8 KV heads): a rank holds the
# same fraction of heads in every layer (a LayerVariant of ModelSpec). Dense first layers; MoE
# layers route with a replicated sigmoid router (gate Linear + router_bias) over stacked experts
# and add a shared expert (share_expert), both split by FFN rows; one all-reduce per MoE block.
STEP3P5 = ArchTable(
    model_types=("step3p5",),
    linears=(
        *attention(),
        col("self_attn.g_proj", Dim.Q_HEADS, width="head_gate"),
        *glu("mlp", Dim.FFN),
        *glu("mlp.switch_mlp", Dim.EXPERT_FFN),
        *glu("mlp.share_expert", Dim.SHARED_EXPERT_FFN),
    ),
    branches=(
        ATTENTION,
        MLP,
        EXPERTS,
        BranchRule(path="mlp.share_expert", kind="mlp", reduce=False),
    ),
    replicated=(*QK_NORMS, "mlp.gate"),
    counts=(
        CountRule(path="self_attn.num_heads", dim=Dim.Q_HEADS),
        CountRule(path="self_attn.num_kv_heads", dim=Dim.KV_HEADS),
    ),
    tie_default=False,
    stages=True,
)

# Step 3.5's names for the usual settings.
_ALIASES = {
    "num_attention_groups": "num_key_value_heads",
    "moe_num_experts": "n_routed_experts",
    "moe_top_k": "num_experts_per_tok",
    "share_expert_dim": "shared_expert_intermediate_size",
}


def settings(config: Config) -> Config:
    """Its settings under the usual names; MoE layers listed (moe_layers_enum), else every
    layer but the first."""
    c = text_config(config)
    out = {**{dst: c[src] for src, dst in _ALIASES.items() if src in c}, **c}
    if "moe_layers_enum" in c:
        enum = str(c["moe_layers_enum"] or "")
        moe = [int(i) for i in enum.split(",") if i.strip()]
        out["first_k_dense_replace"] = min(moe) if moe else 1
    return out


def _other_attention(c: Config, kv_heads: int) -> LayerVariant | None:
    """attention_other_setting: its sliding-window layers' head counts."""
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


def fields(c: Config) -> SpecFields:
    """Its sliding-window layers' query heads (a variant) and the head-wise gate's width."""
    kv_heads = int(c.get("num_key_value_heads") or c["num_attention_heads"])
    other = _other_attention(c, kv_heads)
    out: SpecFields = {"variants": (other,)} if other is not None else {}
    if c.get("use_head_wise_attn_gate"):
        out["head_widths"] = {"head_gate": 1}  # g_proj: one gate row per query head
    return out


FAMILY = Family(tables=(STEP3P5,), settings=settings, fields=fields)
