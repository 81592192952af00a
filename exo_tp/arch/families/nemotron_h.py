"""Nemotron-H: Mamba-2, attention, MLP and MoE layers by a pattern (hybrid_override_pattern)."""

from __future__ import annotations

from exo_tp.arch.dims import Dim
from exo_tp.arch.families._rules import attention, col, only_where, row
from exo_tp.arch.family import Config, Family, SpecFields, text_config
from exo_tp.arch.model_spec import LinearAttention, linear_head_widths
from exo_tp.arch.table import ArchTable, BranchRule, CountRule, LinearRule, Style
from exo_tp.errors import ExoTpError

# Every layer is one `mixer` of one kind (M Mamba-2, * attention, - MLP, E MoE), so each rule
# applies `where` its kind's own module is. A Mamba-2 layer splits by its groups
# (LINEAR_HEADS counts groups here, ModelSpec.linear_attention): B and C belong to a group
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
_G = Dim.LINEAR_HEADS


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


NEMOTRON_H = ArchTable(
    model_types=("nemotron_h",),
    layers="backbone.layers",
    embedding="backbone.embeddings",
    norm="backbone.norm_f",
    linears=(
        *_mamba2(),
        *(only_where(r, _ATTN) for r in attention("mixer")),
        only_where(col("mixer.up_proj", Dim.FFN), _DENSE),
        only_where(row("mixer.down_proj", Dim.FFN), _DENSE),
        only_where(col("mixer.switch_mlp.fc1", Dim.EXPERT_FFN), _MOE),
        only_where(row("mixer.switch_mlp.fc2", Dim.EXPERT_FFN), _MOE),
        only_where(col("mixer.shared_experts.up_proj", Dim.SHARED_EXPERT_FFN), _MOE),
        only_where(row("mixer.shared_experts.down_proj", Dim.SHARED_EXPERT_FFN), _MOE),
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
        CountRule(path="mixer.num_heads", dim=Dim.Q_HEADS, where=_ATTN),
        CountRule(path="mixer.num_key_value_heads", dim=Dim.KV_HEADS, where=_ATTN),
    ),
    tie_default=False,
    # a stage's mask indices follow its slice (exo_tp.shard.apply._first_cached)
    stages=True,
)

# Its layer kinds by their names in layers_block_type / layer_types (mlx-lm's map).
_BLOCK_CHARS = {
    "full_attention": "*",
    "linear_attention": "M",
    "moe": "E",
    "mlp": "-",
    "attention": "*",
    "mamba": "M",
    "conv": "M",
}


def _pattern(c: Config) -> str:
    """One character per layer: hybrid_override_pattern, or the layer kinds' characters."""
    pattern = c.get("hybrid_override_pattern")
    if pattern is None:
        kinds = c.get("layers_block_type") or c.get("layer_types") or ()
        unknown = sorted(set(kinds) - _BLOCK_CHARS.keys())
        if unknown or not kinds:
            raise ExoTpError(f"config.json: unknown or missing layer kinds {unknown}")
        pattern = [_BLOCK_CHARS[k] for k in kinds]
    return "".join(pattern)


def settings(config: Config) -> Config:
    """The layer count is the pattern's length, whatever num_hidden_layers says."""
    c = text_config(config)
    return {**c, "num_hidden_layers": len(_pattern(c))}


def fields(c: Config) -> SpecFields:
    """The layer pattern, its Mamba-2 layers split by groups (as LinearAttention, see its
    mamba2 fields) and the widths the table's rules cut them by; one shared expert of
    moe_shared_expert_intermediate_size (mlx-lm builds one whatever n_shared_experts says)."""
    pattern = _pattern(c)
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
        "linear_attention": linear,
        "head_widths": linear_head_widths(linear),
        "extra_ffn": {Dim.SHARED_EXPERT_FFN: int(shared)} if shared else {},
    }


FAMILY = Family(tables=(NEMOTRON_H,), settings=settings, fields=fields)
