"""Bytes, FLOPs and seconds of the pieces of a plan (pure: plan + scores in, numbers out).

Decode reads every weight a rank uses for a token once, so a rank's compute time per token is
``read_bytes * seconds_per_byte`` (its decode score for the model's weight format, see
`exo_tp.plan.devices`), or, where the device timed the model's matrix shapes (`exo-tp bench
--model`), the sum over the rank's matrices of each one's measured time (`exo_tp.plan.matvec`:
a shard's slice of a matrix may read at another speed per byte than the whole). Prefill is
compute-bound: ``FLOPs / prefill_flops``.

The cost model's parts: this module (a rank's load: what it holds and reads, and the reads'
seconds), `exo_tp.plan.attention_cost` (the attention kinds' weights and caches) and
`exo_tp.plan.collective_cost` (collectives and pipeline hops: the ring model); their names are
importable from here too.

Counted: attention (q, k, v, o; under multi-head latent attention its latent projections,
per-head stacks and DSA's indexer; DeepSeek V4.1's grouped output, KV compressor, indexer and
hyper-connection mixers), every FFN kind as a gated MLP (gate, up, down), MoE experts (held:
all of them; read per token: ``experts_per_token``) and their router, the vocab-parallel
embedding and LM head, norms, the KV cache (MLA's latent cache: replicated on every rank holding
heads). Weights are held in the engine's float dtype (float32: 4 bytes) unless quantized: then
``bits/8`` bytes per weight plus a float scale and bias per group. Not counted: activations
other than the KV cache.

Calibrated on the heterogeneous lab (docs/benchmarks.md, "Heterogeneous lab": 12 plans, two
devices, float32 SmolLM2): a tensor-parallel group synchronises twice per layer, so a token
costs, per segment between two collectives (attention; FFN; the LM head), the slowest rank's
reads for that segment, not the slowest rank's reads for the whole token; each rank also pays
its device's per-layer overhead (`DeviceProfile.layer_overhead_seconds`, measured by the bench:
operation dispatch, norms, rope, short attention), which no split divides; the last stage
pays TOKEN_OVERHEAD_LAYERS of it once per token (sampling, the step loop); a collective costs at
least COLLECTIVE_OVERHEAD_LAYERS of it (`exo_tp.plan.collective_cost`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from exo_tp.arch.dims import Dim
from exo_tp.plan.attention_cost import (
    compressed_attention_matrices,
    kv_bytes_per_token,
    latent_attention_matrices,
    linear_attention_floats,
    linear_attention_matrices,
    state_bytes,
)
from exo_tp.plan.collective_cost import (
    COLLECTIVE_OVERHEAD_LAYERS,
    DEFAULT_LINK,
    FIRST_STAGE_COLLECTIVES,
    HOP_OVERHEAD,
    LAST_STAGE_COLLECTIVES,
    LinkCost,
    all_gather_seconds,
    all_sum_seconds,
    collective_count,
    collective_floor,
    collective_seconds,
    hop_seconds,
)
from exo_tp.plan.devices import quant_key
from exo_tp.plan.matvec import Matrix, MatvecTable, Segment, matrices_seconds
from exo_tp.plan.profiles import ENGINE_DTYPE, FLOAT_BYTES, TOKEN_BYTES
from exo_tp.plan.shard_plan import RankShard, Span
from exo_tp.plan.spec import Frozen, ModelSpec
from exo_tp.plan.tensor_parallel import layer_view

# The cost model's names, wherever they are defined: callers import them from here.
__all__ = [
    "COLLECTIVE_OVERHEAD_LAYERS",
    "DEFAULT_LINK",
    "FIRST_STAGE_COLLECTIVES",
    "FLOAT_BYTES",
    "HOP_OVERHEAD",
    "LAST_STAGE_COLLECTIVES",
    "SEGMENTS",
    "TOKEN_BYTES",
    "TOKEN_OVERHEAD_LAYERS",
    "LinkCost",
    "RankLoad",
    "ReadPrice",
    "all_gather_seconds",
    "all_sum_seconds",
    "bytes_per_weight",
    "collective_count",
    "collective_floor",
    "collective_seconds",
    "hop_seconds",
    "kv_bytes_per_token",
    "layer_groups",
    "layer_matrices",
    "linear_attention_floats",
    "own_read_speed",
    "prefill_flops",
    "rank_load",
    "read_seconds",
    "segment_seconds",
    "stage_kv_bytes_per_token",
    "stage_state_bytes",
    "state_bytes",
    "unread_weights",
    "weight_format",
]

# Fitted on the lab (docs/benchmarks.md): per token, the last stage's sampling and step loop
# cost 8 layers' overhead.
TOKEN_OVERHEAD_LAYERS = 8.0


def weight_format(spec: ModelSpec) -> str:
    """Kernel dtype name the model's linear weights run as: "float32" or e.g. "q4g32"."""
    q = spec.quantization
    return quant_key(q.bits, q.group_size) if q else ENGINE_DTYPE


def bytes_per_weight(
    spec: ModelSpec, float_bytes: int = FLOAT_BYTES, bits: int | None = None
) -> float:
    """Bytes per weight of a linear (``bits``: a module's own, where the config overrides)."""
    q = spec.quantization
    return (bits or q.bits) / 8 + 2 * float_bytes / q.group_size if q else float(float_bytes)


def _expert_kind(spec: ModelSpec) -> Dim:
    # Mixtral and gpt-oss size their experts with intermediate_size (FFN).
    return Dim.EXPERT_FFN if Dim.EXPERT_FFN in spec.ffn_sizes else Dim.FFN


def _rows(shard: RankShard, kind: Dim) -> int:
    """The rank's rows of an FFN kind (0 where the model has none)."""
    return shard.ffn[kind].size if kind in shard.ffn else 0


def layer_matrices(
    spec: ModelSpec, shard: RankShard, moe: bool
) -> list[tuple[Segment, int, int, int]]:
    """(segment, k, n, count) of each weight shape one layer of this rank reads per decoded
    token (``x @ W.T``, W stored (n, k))."""
    h = spec.hidden_size
    q_width = shard.heads.q_heads.size * spec.head_dim
    kv_width = len(shard.heads.kv_heads) * spec.head_dim  # replicated KV heads count each time
    read: list[tuple[Segment, int, int, int]] = [
        ("attention", h, q_width, 1),  # q_proj
        ("attention", h, kv_width, 2 if spec.has_kv else 0),  # k_proj, v_proj (unless shared)
        ("attention", q_width, h, 1),  # o_proj
    ]
    if "head_gate" in spec.head_widths:  # a head-wise gate: one row per query head
        read.append(("attention", h, shard.heads.q_heads.size, 1))
    if "gated_q" in spec.head_widths:  # q_proj's second half: an element-wise output gate
        read.append(("attention", h, q_width, 1))
    if spec.latent_attention is not None:
        read = latent_attention_matrices(spec, spec.latent_attention, shard.heads.q_heads.size)
    if spec.recurrent and spec.linear_attention is not None:
        read = linear_attention_matrices(spec, spec.linear_attention, shard.linear_heads.size)
    if spec.block:  # Nemotron-H: one mixer per layer, of the layer's own kind
        return _block_matrices(spec, shard, read)
    if spec.compressed_attention is not None:
        read = compressed_attention_matrices(spec, spec.compressed_attention, shard.heads.q_heads)
    if spec.hc_mult:  # hyper-connection mixers around attention and FFN, on every rank
        mix = (2 + spec.hc_mult) * spec.hc_mult
        read.append(("attention", spec.hc_mult * h, mix, 2))
    if spec.per_layer_embedding:  # Gemma 4's per-layer input gate and projection, replicated
        width = spec.per_layer_embedding // spec.num_layers
        read += [("ffn", h, width, 1), ("ffn", width, h, 1)]
    dense = _rows(shard, Dim.FFN)
    if not moe:
        return [*read, ("ffn", h, dense, 2), ("ffn", dense, h, 1)]  # gate, up; down
    if spec.dense_mlp_with_experts:  # Gemma 4: a dense MLP beside the experts
        read += [("ffn", h, dense, 2), ("ffn", dense, h, 1)]
    rows = shard.ffn[_expert_kind(spec)].size
    shared = _rows(shard, Dim.SHARED_EXPERT_FFN)
    latent = spec.moe_latent
    if latent:  # the routed experts' replicated down and up projections around them
        read += [("ffn", h, latent, 1), ("ffn", latent, h, 1)]
    width = latent or h
    return [
        *read,
        ("ffn", width, rows, 2 * spec.experts_per_token),
        ("ffn", rows, width, spec.experts_per_token),
        ("ffn", h, shared, 2),
        ("ffn", shared, h, 1),
        ("ffn", h, spec.num_experts, 1),  # the router, replicated on every rank
    ]


def _block_matrices(
    spec: ModelSpec, shard: RankShard, attention: list[tuple[Segment, int, int, int]]
) -> list[tuple[Segment, int, int, int]]:
    """A Nemotron-H layer's one mixer: Mamba-2 (in ``attention`` already), attention, a
    non-gated MLP (up, down) or MoE (non-gated experts, the shared expert, the router)."""
    h = spec.hidden_size
    if spec.block in ("M", "*"):
        return attention
    if spec.block == "-":
        dense = _rows(shard, Dim.FFN)
        return [("ffn", h, dense, 1), ("ffn", dense, h, 1)]
    rows = shard.ffn[_expert_kind(spec)].size
    shared = _rows(shard, Dim.SHARED_EXPERT_FFN)
    return [
        ("ffn", h, rows, spec.experts_per_token),
        ("ffn", rows, h, spec.experts_per_token),
        ("ffn", h, shared, 1),
        ("ffn", shared, h, 1),
        ("ffn", h, spec.num_experts, 1),
    ]


def unread_weights(spec: ModelSpec, shard: RankShard, moe: bool) -> int:
    """Matrix weights one layer of this rank holds but does not read per decoded token: an MoE
    layer holds every expert and reads experts_per_token of them."""
    if not moe:
        return 0
    matrices = 2 if spec.block else 3  # Nemotron-H's experts: up and down, no gate
    unread = (
        (spec.num_experts - spec.experts_per_token)
        * matrices
        * (spec.moe_latent or spec.hidden_size)
    )
    return unread * shard.ffn[_expert_kind(spec)].size


def layer_groups(
    spec: ModelSpec, shard: RankShard, layers: Span
) -> list[tuple[ModelSpec, RankShard, bool, int]]:
    """The layers of ``layers`` grouped by what they hold: (layer view, the rank's share in it,
    MoE, how many layers)."""
    counts: dict[tuple[tuple[int, ...], bool, bool, str], tuple[int, int]] = {}
    linear = spec.linear_attention.layers if spec.linear_attention else ()
    for i in range(layers.start, layers.stop):
        moe = bool(spec.num_experts) and i >= spec.dense_layers
        if spec.block_pattern:  # Nemotron-H: by the layer's kind
            moe = spec.block_pattern[i] == "E"
        variants = tuple(k for k, v in enumerate(spec.variants) if i in v.layers)
        key = (variants, moe, i in linear, spec.block_pattern[i] if spec.block_pattern else "")
        first, n = counts.get(key, (i, 0))
        counts[key] = (first, n + 1)
    out = []
    for (_, moe, *_), (first, n) in counts.items():
        view, mine = layer_view(spec, shard, first)
        out.append((view, mine, moe, n))
    return out


def stage_kv_bytes_per_token(
    spec: ModelSpec, shard: RankShard, layers: Span, float_bytes: int = FLOAT_BYTES
) -> int:
    """KV cache bytes the layers ``layers`` of this rank add per token of context."""
    return _over_layers(layer_groups(spec, shard, layers), kv_bytes_per_token, float_bytes)


def stage_state_bytes(
    spec: ModelSpec, shard: RankShard, layers: Span, float_bytes: int = FLOAT_BYTES
) -> int:
    """Recurrent state the layers ``layers`` of this rank keep per stream (any context)."""
    return _over_layers(layer_groups(spec, shard, layers), state_bytes, float_bytes)


def _over_layers(
    groups: list[tuple[ModelSpec, RankShard, bool, int]],
    per_layer: Callable[[ModelSpec, RankShard, int], int],
    float_bytes: int,
) -> int:
    """``per_layer`` summed over the layers of ``layer_groups`` (each group's count times)."""
    return sum(n * per_layer(view, mine, float_bytes) for view, mine, _, n in groups)


class RankLoad(Frozen):
    """What one rank holds and does for a range of layers (and the vocab, on end stages)."""

    held_bytes: int  # weights in memory
    read_bytes: int  # weights read per decoded token
    flops_per_token: float  # prefill arithmetic per token, without attention scores
    attention_width: int  # local query heads * head_dim, summed over its layers
    kv_bytes_per_token: int  # KV cache per token of context, all its layers
    # Recurrent state per stream (linear-attention layers), constant in context length
    state_bytes: int = 0
    # the weights it reads per token shape by shape, and the norms' bytes (read with the FFN)
    matrices: tuple[Matrix, ...] = ()
    norm_bytes: int = 0


def rank_load(
    spec: ModelSpec,
    shard: RankShard,
    layers: Span,
    first: bool,
    last: bool,
    float_bytes: int = FLOAT_BYTES,
) -> RankLoad:
    per = bytes_per_weight(spec, float_bytes)
    held = 0
    shapes: dict[tuple[Segment, int, int], int] = {}  # weights read per token, by shape
    groups = layer_groups(spec, shard, layers)
    floats = 0  # float parameters that are no matrices (held and read as they are)
    for view, mine, moe, layer_count in groups:
        held += layer_count * unread_weights(view, mine, moe)
        floats += layer_count * linear_attention_floats(view, mine)
        for segment, k, n, count in layer_matrices(view, mine, moe):
            held += layer_count * k * n * count
            shapes[segment, k, n] = shapes.get((segment, k, n), 0) + layer_count * count
    vocab = shard.vocab.size * spec.hidden_size
    # hidden-size vectors: two norms per layer and the final one; attention residuals add two
    # projections and two norms per layer and one of each before the final norm
    per_layer, final = (6, 3) if spec.attention_residuals else (2, 1)
    vectors = per_layer * layers.size + (final if last else 0)
    norms = (vectors * spec.hidden_size + floats) * float_bytes
    q = spec.quantization
    embedding = bytes_per_weight(spec, float_bytes, q.embedding_bits if q else None)
    head = bytes_per_weight(spec, float_bytes, q.head_bits if q else None)
    vocab_bytes = 0.0
    if last:  # LM head shard (or the tied embedding it shares)
        vocab_bytes += vocab * (embedding if spec.tie_word_embeddings else head)
        shapes["head", spec.hidden_size, shard.vocab.size] = 1
    if first and not (last and spec.tie_word_embeddings):
        vocab_bytes += vocab * embedding  # embedding shard; a lookup reads one row, not counted
    vocab_held = 0
    if first and spec.per_layer_embedding:
        # Gemma 4: per-layer input embeddings (vocab-split) and their projection (replicated)
        vocab_held += (shard.vocab.size + spec.hidden_size) * spec.per_layer_embedding
        key: tuple[Segment, int, int] = ("head", spec.hidden_size, spec.per_layer_embedding)
        shapes[key] = shapes.get(key, 0) + 1
    read = sum(k * n * count for (_, k, n), count in shapes.items())
    return RankLoad(
        held_bytes=round((held + vocab_held) * per + vocab_bytes + norms),
        read_bytes=round(read * per + norms),
        flops_per_token=2.0 * read,
        # attention scores grow with the prompt; a linear-attention layer's recurrence does not
        attention_width=sum(
            n * mine.heads.q_heads.size * v.head_dim
            for v, mine, _, n in groups
            if not v.recurrent and v.block in ("", "*")
        ),
        kv_bytes_per_token=_over_layers(groups, kv_bytes_per_token, float_bytes),
        state_bytes=_over_layers(groups, state_bytes, float_bytes),
        matrices=tuple(
            Matrix(segment=g, k=k, n=n, count=c, bytes=round(k * n * c * per))
            for (g, k, n), c in shapes.items()
            if k and n and c
        ),
        norm_bytes=norms,
    )


SEGMENTS: tuple[Segment, ...] = ("attention", "ffn", "head")


class ReadPrice(Protocol):
    """What prices a rank's weight reads: its decode score, and its measured matvec shapes
    for the model's weight format (empty: every byte at the score)."""

    @property
    def seconds_per_byte(self) -> float: ...

    @property
    def matvec(self) -> MatvecTable: ...


def segment_seconds(load: RankLoad, device: ReadPrice) -> tuple[float, ...]:
    """Seconds of weight reads per token in each segment between collectives: attention, FFN
    (with the norms), LM head."""
    return tuple(
        matrices_seconds(
            [m for m in load.matrices if m.segment == segment],
            device.matvec,
            device.seconds_per_byte,
        )
        + (load.norm_bytes * device.seconds_per_byte if segment == "ffn" else 0.0)
        for segment in SEGMENTS
    )


def own_read_speed(load: RankLoad, device: ReadPrice) -> float:
    """Bytes/s at which ``device`` reads ``load``'s weights (its matrices at their shapes), or
    0 where they take no time."""
    seconds = sum(segment_seconds(load, device))
    return load.read_bytes / seconds if seconds > 0 else 0.0


def read_seconds(loads: Sequence[RankLoad], devices: Sequence[ReadPrice]) -> float:
    """Seconds per token of a TP group's weight reads: each segment waits for its slowest
    rank (a split balanced over the whole layer but not per segment still pays)."""
    segments = [segment_seconds(x, d) for x, d in zip(loads, devices, strict=True)]
    return sum(max(s[i] for s in segments) for i in range(len(SEGMENTS)))


def prefill_flops(load: RankLoad, tokens: int) -> float:
    """FLOPs of a prompt of ``tokens``: weights, plus causal attention scores and mixing."""
    return load.flops_per_token * tokens + 2.0 * load.attention_width * tokens * tokens
