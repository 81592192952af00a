"""LFM2: short convolutions beside attention."""

from __future__ import annotations

from exo_tp.arch.dims import Dim
from exo_tp.arch.families._rules import ATTENTION, col, row
from exo_tp.arch.family import Config, Family, SpecFields
from exo_tp.arch.model_spec import LinearAttention, linear_head_widths
from exo_tp.arch.table import ArchTable, BranchRule, CountRule, LinearRule, Style

# A short-conv layer (every layer but full_attn_idxs) splits by channels (LINEAR_HEADS counts
# channels, one wide, ModelSpec.linear_attention): its in_proj's B, C and x rows of the
# rank's channels (B * x and C * conv act channel by channel), their depthwise conv taps (groups
# follow the local channel count) and so their conv state; out_proj row-parallel (one
# all-reduce). The unit grows to the quantization group (out_proj's column cut). The conv reads
# its channel count from the model's shared ModelArgs: each block gets its own copy. Attention
# as llama's with per-head q/k layernorms replicated; the SwiGLU MLP w1/w3 column, w2 row.
_CONV = "conv.in_proj"
_G = Dim.LINEAR_HEADS
# its SwiGLU MLP's projections (no width: FFN rows are no heads)
_SWIGLU: tuple[tuple[str, Style], ...] = (("w1", "column"), ("w3", "column"), ("w2", "row"))


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
        col("self_attn.q_proj", Dim.Q_HEADS),
        col("self_attn.k_proj", Dim.KV_HEADS),
        col("self_attn.v_proj", Dim.KV_HEADS),
        row("self_attn.out_proj", Dim.Q_HEADS),
        *(LinearRule(path=f"feed_forward.{p}", style=s, parts=(Dim.FFN,)) for p, s in _SWIGLU),
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
        CountRule(path="self_attn.n_heads", dim=Dim.Q_HEADS, where="self_attn"),
        CountRule(path="self_attn.n_kv_heads", dim=Dim.KV_HEADS, where="self_attn"),
    ),
    reads_head_dim=False,
    # a stage's first attention / conv layer follows its slice (exo_tp.shard.apply)
    stages=True,
)


def _ffn_width(c: Config) -> int:
    """Its MLP's width as mlx-lm derives it (auto-adjusted: 2/3 of it, times the multiplier,
    rounded up to block_multiple_of)."""
    ff = int(c.get("block_ff_dim") or c["intermediate_size"])
    if c.get("block_auto_adjust_ff_dim"):
        ff = int(2 * ff / 3)
        if c.get("block_ffn_dim_multiplier") is not None:
            ff = int(float(c["block_ffn_dim_multiplier"]) * ff)
        multiple = int(c.get("block_multiple_of") or 1)
        ff = multiple * ((ff + multiple - 1) // multiple)
    return ff


def fields(c: Config) -> SpecFields:
    """Its short-conv layers (all but full_attn_idxs / the full_attention layer types) split
    by channels, and its MLP's width."""
    layers = int(c["num_hidden_layers"])
    full = c.get("full_attn_idxs")
    if full is None:
        full = [i for i, t in enumerate(c.get("layer_types") or ()) if t == "full_attention"]
    ff = _ffn_width(c)
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
        "extra_ffn": {Dim.FFN: ff},
    }


FAMILY = Family(tables=(LFM2,), fields=fields)
