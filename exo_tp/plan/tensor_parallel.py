"""Uneven tensor-parallel plans: any number of ranks, shares proportional to device weights.

Units never break the math: attention is split by whole GQA groups (query heads stay with their KV
head) or, with more ranks than KV heads, by query heads with the KV heads they need replicated;
any split along an input dimension (o_proj, down_proj) lands on a quantization-group boundary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from exo_tp.arch import table_for
from exo_tp.arch.dims import ATTENTION_HEAD_DIMS, Dim
from exo_tp.errors import PlanError
from exo_tp.plan.apportion import contiguous_spans, largest_remainder, normalize
from exo_tp.plan.shard_plan import Collective, HeadShard, RankShard, ShardPlan, Span
from exo_tp.plan.spec import ModelSpec

# Row alignment of float FFN splits: whole 32-float (128-byte) runs keep matmuls vector-friendly.
FLOAT_FFN_ALIGN = 32
VOCAB_ALIGN = 64


def _row_head_widths(spec: ModelSpec, dims: tuple[Dim, ...] = ATTENTION_HEAD_DIMS) -> set[int]:
    """Columns per head of every weight the architecture splits along its input by heads of
    ``dims`` (o_proj: head_dim, or v_head_dim under MLA), in every layer view."""
    table = table_for(spec.model_type)
    return {
        width
        for view in spec.layer_specs()
        for rule in table.linears
        if rule.style == "row"
        for part, width in zip(rule.parts, rule.part_widths(view.head_width), strict=True)
        if part in dims
    }


def _linear_head_unit(spec: ModelSpec) -> int:
    """Linear-attention heads per unit: one, grown until the row-parallel output projection's
    cut (``unit * head width``) lands on a quantization group."""
    if spec.linear_attention is None:
        return 1
    widths = _row_head_widths(spec, (Dim.LINEAR_HEADS,))
    return math.lcm(1, *(math.lcm(w, spec.input_align) // w for w in widths))


def _head_unit(spec: ModelSpec, by_group: bool) -> int:
    """Query heads per unit: a GQA group (or single head), grown until every input-column cut
    by heads (``unit * width``) lands on a quantization group, in every layer view
    (``ModelSpec.variants``): where a layer has other KV heads the unit holds whole groups of
    it too, and where it has another query-head count the unit scales to whole heads there,
    aligned alike."""
    base = spec.group_size if by_group else 1
    grow = math.lcm(
        1, *(math.lcm(base * w, spec.input_align) // (base * w) for w in _row_head_widths(spec))
    )
    unit = base * grow

    def whole(heads: int) -> bool:
        for view in spec.layer_specs():
            scaled, rest = divmod(heads * view.num_heads, spec.num_heads)
            if rest or (by_group and scaled % view.group_size):
                return False
            if any(scaled * w % spec.input_align for w in _row_head_widths(view)):
                return False
        return True

    grown = unit
    while not whole(grown):
        grown += unit
    return grown


def _scaled_heads(spec: ModelSpec, view: ModelSpec, heads: HeadShard) -> HeadShard:
    """A rank's heads in a layer view: its query-head span scaled to the view's query-head
    count (the same span where it has the model's), with the KV heads they need there."""
    q = heads.q_heads
    if view.num_heads != spec.num_heads:
        q = Span(
            start=q.start * view.num_heads // spec.num_heads,
            stop=q.stop * view.num_heads // spec.num_heads,
        )
    return HeadShard(q_heads=q, kv_heads=kv_heads_for(q, view.group_size))


def kv_heads_for(q_heads: Span, group_size: int) -> tuple[int, ...]:
    """KV head per local slot for a run of query heads; replicates KV heads only as needed."""
    runs: dict[int, int] = {}
    for q in range(q_heads.start, q_heads.stop):
        runs[q // group_size] = runs.get(q // group_size, 0) + 1
    if not runs:
        return ()
    repeat = math.gcd(*runs.values())
    return tuple(kv for kv, n in runs.items() for _ in range(n // repeat))


def layer_view(spec: ModelSpec, shard: RankShard, layer: int) -> tuple[ModelSpec, RankShard]:
    """The sizes and the rank's share of one layer: its variants' query heads (the rank's span
    scaled), head width and KV heads (replicated as needed), its FFN kinds' spans."""
    view = spec.layer(layer)
    if view is spec:
        return spec, shard
    changes: dict[str, object] = {}
    if view.num_kv_heads != spec.num_kv_heads or view.num_heads != spec.num_heads:
        changes["heads"] = _scaled_heads(spec, view, shard.heads)
    remap = {kind: src for v in spec.variants if layer in v.layers for kind, src in v.ffn.items()}
    if remap:
        changes["ffn"] = {**shard.ffn, **{kind: shard.ffn[src] for kind, src in remap.items()}}
    return view, shard.model_copy(update=changes)


def layer_plan(plan: ShardPlan, layer: int) -> ShardPlan:
    """``plan`` as one layer sees it (see layer_view); ``plan`` itself for a plain layer."""
    if not plan.spec.variants:
        return plan
    views = [layer_view(plan.spec, s, layer) for s in plan.ranks]
    return plan.model_copy(update={"spec": views[0][0], "ranks": tuple(s for _, s in views)})


def _ffn_unit(spec: ModelSpec) -> int:
    return math.lcm(FLOAT_FFN_ALIGN if spec.quantization is None else 1, spec.input_align)


def split_grains(spec: ModelSpec) -> dict[Dim, int]:
    """The finest unit of every split dimension over all plans of ``spec``, any rank count:
    every span a plan gives starts at a multiple of it (query heads, KV heads, rows, tokens)
    or at the dimension's end.

    Weight manifests cut their digest blocks on these, so any plan's slice is whole blocks.
    (A GQA-group head unit is a multiple of the single-head one: see _head_unit.)
    """
    return {
        Dim.Q_HEADS: _head_unit(spec, by_group=False),
        Dim.KV_HEADS: 1,
        Dim.LINEAR_HEADS: _linear_head_unit(spec),
        Dim.VOCAB: VOCAB_ALIGN,
        **{kind: _ffn_unit(spec) for kind in spec.ffn_sizes},
    }


def _split(total: int, unit: int, weights: Sequence[float]) -> tuple[Span, ...]:
    counts = largest_remainder(math.ceil(total / unit), weights)
    return contiguous_spans(counts, unit, total)


def _collectives(spec: ModelSpec, vocab_sizes: tuple[int, ...]) -> tuple[Collective, ...]:
    """The collectives a TP group over ``len(vocab_sizes)`` ranks runs (``vocab_sizes``: each
    rank's share of the vocabulary)."""
    n = len(vocab_sizes)
    collectives: tuple[Collective, ...] = (
        # Row-parallel outputs are full hidden vectors on every rank: equal shapes, no padding.
        Collective(
            name="attention_out",
            op="all_sum",
            sizes=(spec.hidden_size,) * n,
            padded=spec.hidden_size,
            per_layer=1,
        ),
        Collective(
            name="ffn_out",
            op="all_sum",
            sizes=(spec.hidden_size,) * n,
            padded=spec.hidden_size,
            # Gemma 4 MoE: the dense MLP and the experts are reduced apart (own post-norms)
            per_layer=2 if spec.dense_mlp_with_experts else 1,
        ),
        Collective(
            name="embedding", op="all_sum", sizes=(spec.hidden_size,) * n, padded=spec.hidden_size
        ),
        # Vocab shards differ in size: padded to the largest before the gather.
        Collective(name="logits", op="all_gather", sizes=vocab_sizes, padded=max(vocab_sizes)),
    )
    if spec.per_layer_embedding:  # Gemma 4's per-layer input embeddings, vocab-split
        width = spec.per_layer_embedding
        collectives += (
            Collective(name="per_layer_embedding", op="all_sum", sizes=(width,) * n, padded=width),
        )
    if spec.moe_latent_norm:  # the routed experts' latent sum, before its norm (MoE layers)
        width = spec.moe_latent
        collectives += (
            Collective(
                name="moe_latent", op="all_sum", sizes=(width,) * n, padded=width, per_layer=1
            ),
        )
    norms = len(table_for(spec.model_type).norms)
    if norms:
        # Full-width q/k norms: one sum of squares per position each (latency, not bytes).
        collectives += (
            Collective(name="qk_norm", op="all_sum", sizes=(1,) * n, padded=1, per_layer=norms),
        )
    return collectives


def plan_tensor_parallel(spec: ModelSpec, weights: Sequence[float]) -> ShardPlan:
    """One TP group over ``len(weights)`` ranks; rank r's share tracks ``weights[r]``."""
    shares = normalize(weights)
    n = len(shares)
    table = table_for(spec.model_type)
    if n > 1 and not table.split:
        raise PlanError(f"{n} ranks in one stage: {table.why}")
    by_group = n <= min(v.num_kv_heads for v in spec.layer_specs())
    head_unit = _head_unit(spec, by_group)
    q_spans = _split(spec.num_heads, head_unit, shares)
    ffn_unit = _ffn_unit(spec)
    ffn_spans = {kind: _split(size, ffn_unit, shares) for kind, size in spec.ffn_sizes.items()}
    vocab_spans = _split(spec.vocab_size, VOCAB_ALIGN, shares)
    # Linear-attention heads: whole units proportional to the shares, apart from the
    # attention heads (their own count); more ranks than units leave some without any.
    linear = spec.linear_attention
    linear_unit = _linear_head_unit(spec)
    linear_spans = (
        _split(linear.num_heads, linear_unit, shares)
        if linear is not None
        else (Span(start=0, stop=0),) * n
    )
    ranks = tuple(
        RankShard(
            rank=r,
            weight=shares[r],
            heads=HeadShard(q_heads=q_spans[r], kv_heads=kv_heads_for(q_spans[r], spec.group_size)),
            ffn={kind: spans[r] for kind, spans in ffn_spans.items()},
            vocab=vocab_spans[r],
            linear_heads=linear_spans[r],
        )
        for r in range(n)
    )
    collectives = _collectives(spec, tuple(s.size for s in vocab_spans))
    return ShardPlan(
        spec=spec,
        weights=shares,
        attention_unit="kv_group" if by_group else "q_head",
        head_unit=head_unit,
        linear_head_unit=linear_unit,
        ffn_unit=ffn_unit,
        vocab_unit=VOCAB_ALIGN,
        ranks=ranks,
        collectives=collectives,
    )
