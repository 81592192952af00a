"""Human-readable text of a shard plan."""

from __future__ import annotations

from exo_tp.plan.pipeline import PipelinePlan
from exo_tp.plan.shard_plan import ShardPlan
from exo_tp.plan.spec import LayerVariant, LinearAttention


def _variant(variant: LayerVariant) -> str:
    """What some layers have instead (ModelSpec.variants)."""
    parts = [
        *([f"{variant.num_heads} heads: spans scaled"] if variant.num_heads else []),
        *([f"head_dim {variant.head_dim}"] if variant.head_dim else []),
        *([f"{variant.num_kv_heads} KV heads"] if variant.num_kv_heads else []),
        *([] if variant.has_kv else ["KV shared"]),
        *(f"{kind} as {src}" for kind, src in variant.ffn.items()),
        *([" + ".join(variant.parts)] if variant.parts else []),
        *([f"1 KV entry per {variant.compress_ratio} tokens"] if variant.compress_ratio else []),
    ]
    return ", ".join(parts)


def _linear(linear: LinearAttention) -> str:
    heads = f"{linear.num_heads} heads x {linear.head_dim}"
    if linear.gated_deltanet:  # the split unit: a key head with its value heads
        heads = (
            f"{linear.num_heads} key heads x {linear.head_dim}, each with "
            f"{linear.value_heads} value heads x {linear.value_head_dim}"
        )
    if linear.mamba2:  # the split unit: a group with its heads, B and C
        per = linear.head_dim // linear.heads_per_group
        return (
            f", {len(linear.layers)} Mamba-2 layers of {linear.num_heads} groups x "
            f"{linear.heads_per_group} heads x {per}, state {linear.state_size} (split by group)"
        )
    if linear.short_conv:
        return (
            f", {len(linear.layers)} short-conv layers of {linear.num_heads} channels, kernel "
            f"{linear.conv_kernel} (split by channel)"
        )
    return f", {len(linear.layers)} linear-attention layers of {heads} (recurrent state)"


def render_plan(plan: ShardPlan) -> str:
    spec = plan.spec
    linear = spec.linear_attention
    lines = [
        f"model {spec.model_type}: {spec.num_layers} layers, hidden {spec.hidden_size}, "
        f"{spec.num_heads} heads / {spec.num_kv_heads} KV heads x {spec.head_dim}"
        + "".join(
            f", {name} {width}"
            for name, width in spec.head_widths.items()
            if not name.startswith(("linear_", "mamba_"))  # said with the recurrent layers
        )
        + "".join(f" ({_variant(v)} in {len(v.layers)} layers)" for v in spec.variants)
        + (_linear(linear) if linear else "")
        + ", "
        f"ffn {spec.ffn_sizes}, vocab {spec.vocab_size}"
        + (
            f", {spec.quantization.bits}-bit group {spec.quantization.group_size}"
            if spec.quantization
            else ""
        ),
        f"{plan.size} ranks; attention split by {plan.attention_unit} "
        f"({plan.head_unit} q heads/unit), ffn unit {plan.ffn_unit} rows, "
        f"vocab unit {plan.vocab_unit} rows"
        + (f", linear-attention unit {plan.linear_head_unit} heads" if linear else ""),
        f"{'rank':>4} {'weight':>7} {'q heads':>9} {'kv heads':>12} "
        + (f"{'linear heads':>13} " if linear else "")
        + " ".join(f"{kind:>13}" for kind in spec.ffn_sizes)
        + f" {'vocab rows':>15}",
    ]
    for r in plan.ranks:
        q, lin = r.heads.q_heads, r.linear_heads
        lines.append(
            f"{r.rank:>4} {r.weight:>7.3f} {f'{q.start}-{q.stop} ({q.size})':>9} "
            f"{','.join(map(str, r.heads.kv_heads)) or '-':>12} "
            + (f"{f'{lin.start}-{lin.stop} ({lin.size})':>13} " if linear else "")
            + " ".join(f"{f'{s.start}-{s.stop} ({s.size})':>13}" for s in r.ffn.values())
            + f" {f'{r.vocab.start}-{r.vocab.stop}':>15}"
        )
    for c in plan.collectives:
        pad = [c.padded - s for s in c.sizes]
        per = f"{c.per_layer}x per layer" if c.per_layer else "once per forward"
        lines.append(
            f"collective {c.name}: {c.op} {per}, {c.padded} wide"
            + (f", padding per rank {pad}" if any(pad) else "")
        )
    return "\n".join(lines)


def describe(plan: PipelinePlan) -> str:
    """One line: the stages, their layers and shares."""
    stages = [
        f"layers {s.layers.start}-{s.layers.stop} on ranks "
        f"{','.join(map(str, s.ranks))} (shares "
        f"{'/'.join(f'{w:.2f}' for w in s.tp.weights)})"
        for s in plan.stages
    ]
    kind = "tensor parallel" if len(plan.stages) == 1 else f"{len(plan.stages)}-stage pipeline"
    return f"{kind}: " + "; ".join(stages)
