"""Bytes, FLOPs and seconds of the pieces of a plan (pure: plan + scores in, numbers out).

Decode reads every weight a rank uses for a token once, so a rank's compute time per token is
``read_bytes * seconds_per_byte`` (its decode score for the model's weight format, see
`exo_tp.plan.devices`), or, where the device timed the model's matrix shapes (`exo-tp bench
--model`), the sum over the rank's matrices of each one's measured time (`exo_tp.plan.matvec`:
a shard's slice of a matrix may read at another speed per byte than the whole). Prefill is
compute-bound: ``FLOPs / prefill_flops``.

Collectives are priced by a ring model fitted to the 2-rank link measurements of `exo-tp bench`
(L: all_sum latency of 4 KB, B: all_sum payload rate of 8 MB). A ring step moving s bytes costs
L/2 + s/B (a 2-rank all_sum is two such steps of b/2):

    all_sum of b bytes over n ranks:        2(n-1) steps of b/n  =  (n-1) L + 2(n-1)/n * b/B
    all_gather of p bytes from each rank:   (n-1) steps of p     =  (n-1) (L/2 + p/B)

A pipeline hop (TCP, `exo_tp.runtime.pipeline`) of b bytes to k ranks costs
HOP_OVERHEAD + L + k * b/B.

Counted: attention (q, k, v, o; under multi-head latent attention its latent projections,
per-head stacks and DSA's indexer, see `_latent_attention_matrices`; DeepSeek V4.1's grouped
output, KV compressor, indexer and hyper-connection mixers, `_compressed_attention_matrices`),
every FFN kind as a gated
MLP (gate, up, down), MoE experts (held: all of them; read per token: ``experts_per_token``)
and their router, the vocab-parallel embedding and LM head, norms, the KV cache (MLA's latent
cache: replicated on every rank holding heads). Weights are held in the engine's float dtype
(float32: 4 bytes) unless quantized: then ``bits/8`` bytes per weight plus a float scale and
bias per group. Not counted: activations other than the KV cache.

Calibrated on the heterogeneous lab (docs/benchmarks.md, "Heterogeneous lab": 12 plans, two
devices, float32 SmolLM2): a tensor-parallel group synchronises twice per layer, so a token
costs, per segment between two collectives (attention; FFN; the LM head), the slowest rank's
reads for that segment, not the slowest rank's reads for the whole token; each rank also pays
its device's per-layer overhead (`DeviceProfile.layer_overhead_seconds`, measured by the bench:
operation dispatch, norms, rope, short attention), which no split divides; the last stage
pays TOKEN_OVERHEAD_LAYERS of it once per token (sampling, the step loop); a collective costs at
least COLLECTIVE_OVERHEAD_LAYERS of it (handing the stream over and waking the ring threads
inside a graph), or its link's latency where that is larger: both figures estimate one cost, and
the link probe's in-graph figure sees it all on some machines and little of it on others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from pydantic import Field

from exo_tp.plan.devices import quant_key
from exo_tp.plan.mamba_cost import (
    mamba_floats,
    mamba_matrices,
    mamba_state_bytes,
    short_conv_floats,
    short_conv_matrices,
    short_conv_state_bytes,
)
from exo_tp.plan.matvec import Matrix, MatvecTable, Segment, matrices_seconds
from exo_tp.plan.profiles import ENGINE_DTYPE
from exo_tp.plan.shard_plan import Collective, RankShard, ShardPlan, Span
from exo_tp.plan.spec import (
    CompressedAttention,
    Frozen,
    LatentAttention,
    LinearAttention,
    ModelSpec,
)
from exo_tp.plan.tensor_parallel import layer_view

FLOAT_BYTES = 4  # float32, the engine's compute dtype for float weights and activations
TOKEN_BYTES = 4  # a token id on the wire (int32)
# What a hop adds beyond its link: the receiving rank waits blocked on a socket (it must not
# spin) and wakes on the scheduler's next tick. bench/pipeline_hop.py measured 8.0 ms per token
# for a 2-stage pipeline over plain mlx-lm (two hops) against an 18 µs raw one-way hop.
HOP_OVERHEAD = 4e-3
# Fitted on the lab (docs/benchmarks.md): per token, the last stage's sampling and step loop
# cost 8 layers' overhead. A collective costs at least half of one layer's overhead: measured
# directly (a 2-rank decode with its all_sums and a build without them) at 0.17 ms on a VM whose
# layers cost 0.34 ms and whose link probe saw 56-60 us in a graph, and at ~0.4 ms on a noisier
# VM whose layers cost 0.5-0.8 ms and whose probe saw 180-460 us. The model first added 0.65 of
# a layer to the probe's figure: it priced the second VM's collectives at twice their cost.
TOKEN_OVERHEAD_LAYERS = 8.0
COLLECTIVE_OVERHEAD_LAYERS = 0.5
# Collectives that run once per forward on the first / last stage only.
FIRST_STAGE_COLLECTIVES = frozenset({"embedding", "per_layer_embedding"})
LAST_STAGE_COLLECTIVES = frozenset({"logits"})


class LinkCost(Frozen):
    # seconds of a 2-rank all_sum of a small (4 KB) message, inside a compute graph if measured
    latency: float = Field(gt=0)
    bandwidth: float = Field(gt=0)  # payload bytes/s of a large (8 MB) 2-rank all_sum
    measured: bool


# Assumed when no link was measured: a switched LAN, ~200 us per small all_sum, 1 GB/s.
DEFAULT_LINK = LinkCost(latency=200e-6, bandwidth=1e9, measured=False)


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


def _expert_kind(spec: ModelSpec) -> str:
    # Mixtral and gpt-oss size their experts with intermediate_size ("ffn").
    return "expert_ffn" if "expert_ffn" in spec.ffn_sizes else "ffn"


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
        read = _latent_attention_matrices(spec, spec.latent_attention, shard.heads.q_heads.size)
    if spec.recurrent and spec.linear_attention is not None:
        read = _linear_attention_matrices(spec, spec.linear_attention, shard.linear_heads.size)
    if spec.block:  # Nemotron-H: one mixer per layer, of the layer's own kind
        return _block_matrices(spec, shard, read)
    if spec.compressed_attention is not None:
        read = _compressed_attention_matrices(spec, spec.compressed_attention, shard.heads.q_heads)
    if spec.hc_mult:  # hyper-connection mixers around attention and FFN, on every rank
        mix = (2 + spec.hc_mult) * spec.hc_mult
        read.append(("attention", spec.hc_mult * h, mix, 2))
    if spec.per_layer_embedding:  # Gemma 4's per-layer input gate and projection, replicated
        width = spec.per_layer_embedding // spec.num_layers
        read += [("ffn", h, width, 1), ("ffn", width, h, 1)]
    dense = shard.ffn["ffn"].size if "ffn" in shard.ffn else 0
    if not moe:
        return [*read, ("ffn", h, dense, 2), ("ffn", dense, h, 1)]  # gate, up; down
    if spec.dense_mlp_with_experts:  # Gemma 4: a dense MLP beside the experts
        read += [("ffn", h, dense, 2), ("ffn", dense, h, 1)]
    rows = shard.ffn[_expert_kind(spec)].size
    shared = shard.ffn["shared_expert_ffn"].size if "shared_expert_ffn" in shard.ffn else 0
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
        dense = shard.ffn["ffn"].size if "ffn" in shard.ffn else 0
        return [("ffn", h, dense, 1), ("ffn", dense, h, 1)]
    rows = shard.ffn[_expert_kind(spec)].size
    shared = shard.ffn["shared_expert_ffn"].size if "shared_expert_ffn" in shard.ffn else 0
    return [
        ("ffn", h, rows, spec.experts_per_token),
        ("ffn", rows, h, spec.experts_per_token),
        ("ffn", h, shared, 1),
        ("ffn", shared, h, 1),
        ("ffn", h, spec.num_experts, 1),
    ]


def _latent_attention_matrices(
    spec: ModelSpec, mla: LatentAttention, heads: int
) -> list[tuple[Segment, int, int, int]]:
    """MLA's weights on a rank holding ``heads`` query heads: the per-head parts split, the
    latent projections (and DSA's indexer) whole on every rank that holds a head (a rank
    without heads runs a zero stand-in and holds none of them)."""
    if not heads:
        return []
    h, qk = spec.hidden_size, spec.head_dim
    v = spec.head_width("v_head_dim")
    nope = qk - mla.rope_dim
    latent = mla.kv_lora_rank
    if mla.q_lora_rank:  # q_a (replicated), q_b (per head)
        read = [("attention", h, mla.q_lora_rank, 1), ("attention", mla.q_lora_rank, heads * qk, 1)]
    else:
        read = [("attention", h, heads * qk, 1)]  # q_proj
    read.append(("attention", h, latent + mla.rope_dim, 1))  # kv_a, replicated
    if mla.latent_cache:  # kv_b absorbed: embed_q and unembed_out, one matrix per head
        read += [("attention", nope, latent, heads), ("attention", latent, v, heads)]
    else:
        read.append(("attention", latent, heads * (nope + v), 1))  # kv_b
    read.append(("attention", heads * v, h, 1))  # o_proj
    if mla.output_gate:
        read.append(("attention", h, heads * v, 1))  # g_proj
    if mla.index_heads:  # DSA's indexer, replicated: wq_b, wk, weights_proj
        read += [
            ("attention", mla.q_lora_rank, mla.index_heads * mla.index_head_dim, 1),
            ("attention", h, mla.index_head_dim, 1),
            ("attention", h, mla.index_heads, 1),
        ]
    return read


def _linear_attention_matrices(
    spec: ModelSpec, linear: LinearAttention, heads: int
) -> list[tuple[Segment, int, int, int]]:
    """A linear-attention layer's weights on a rank holding ``heads`` of its heads: the per-head
    rows of q|k|v, the decay, the output gate and beta, o_proj's columns, and the replicated
    low-rank inputs of the decay and the gate (none on a rank without heads: a stand-in)."""
    if not heads:
        return []
    if linear.mamba2:
        return mamba_matrices(spec.hidden_size, linear, heads)
    if linear.short_conv:
        return short_conv_matrices(spec.hidden_size, heads)
    h, d = spec.hidden_size, linear.head_dim
    if linear.gated_deltanet:  # per key head: q, k, its value heads' v and z rows; b and a
        values = heads * linear.value_heads
        width = values * linear.value_head_dim
        return [
            ("attention", h, heads * 2 * d + 2 * width, 1),  # in_proj_qkv(z)
            ("attention", h, 2 * values, 1),  # in_proj_b, in_proj_a (or in_proj_ba)
            ("attention", width, h, 1),  # out_proj
        ]
    width = heads * d
    read: list[tuple[Segment, int, int, int]] = [
        ("attention", h, 3 * width, 1),  # qkv_proj
        ("attention", h, d, 1),  # f_a_proj, replicated
        ("attention", d, width, 1),  # f_b_proj
        ("attention", h, heads, 1),  # b_proj
        ("attention", width, h, 1),  # o_proj
    ]
    if linear.full_rank_gate:
        read.append(("attention", h, width, 1))  # g_proj
    else:
        read += [("attention", h, d, 1), ("attention", d, width, 1)]  # g_a (replicated), g_b
    return read


def linear_attention_floats(spec: ModelSpec, shard: RankShard) -> int:
    """Float parameters of a linear-attention layer of this rank that are no matrices (its
    heads' conv channels, A_log and dt_bias, and the shared output norm)."""
    linear = spec.linear_attention
    heads = shard.linear_heads.size
    if not spec.recurrent or linear is None or not heads:
        return 0
    if linear.mamba2:
        return mamba_floats(linear, heads)
    if linear.short_conv:
        return short_conv_floats(linear, heads)
    d = linear.head_dim
    if linear.gated_deltanet:  # conv channels, A_log and dt_bias per value head, the norm
        values, dv = heads * linear.value_heads, linear.value_head_dim
        return heads * (2 * d + linear.value_heads * dv) * linear.conv_kernel + 2 * values + dv
    return 3 * heads * d * linear.conv_kernel + heads + heads * d + d


def state_bytes(spec: ModelSpec, shard: RankShard, float_bytes: int = FLOAT_BYTES) -> int:
    """Recurrent state one linear-attention layer of this rank keeps per stream, whatever the
    context length: head_dim x head_dim float32 per head, and the last conv_kernel - 1 inputs of
    its conv channels."""
    linear = spec.linear_attention
    heads = shard.linear_heads.size
    if not spec.recurrent or linear is None:
        return 0
    if linear.mamba2:
        return mamba_state_bytes(linear, heads, float_bytes)
    if linear.short_conv:
        return short_conv_state_bytes(linear, heads, float_bytes)
    d = linear.head_dim
    if linear.gated_deltanet:  # value_head_dim x head_dim per value head; q, k, v channels
        dv = linear.value_head_dim
        channels = heads * (2 * d + linear.value_heads * dv)
        state = heads * linear.value_heads * dv * d * 4
        return state + (linear.conv_kernel - 1) * channels * float_bytes
    return heads * d * d * 4 + (linear.conv_kernel - 1) * 3 * heads * d * float_bytes


def _compressed_attention_matrices(
    spec: ModelSpec, attention: CompressedAttention, heads: Span
) -> list[tuple[Segment, int, int, int]]:
    """DeepSeek V4.1's attention weights on a rank holding query heads ``heads``: their q_b
    rows, the o_a entries and o_b columns of each output group they touch; the q_a latent, the
    shared key/value projection and, in the layers holding them (``spec.parts``), the KV
    compressor and the indexer whole (a rank without heads runs a zero stand-in: none)."""
    if not heads.size:
        return []
    h, d, a = spec.hidden_size, spec.head_dim, attention
    per_group = spec.num_heads // a.o_groups
    touched = (heads.stop - 1) // per_group - heads.start // per_group + 1
    read: list[tuple[Segment, int, int, int]] = [
        ("attention", h, a.q_lora_rank, 1),  # q_a
        ("attention", a.q_lora_rank, heads.size * d, 1),  # q_b
        ("attention", h, d, 1),  # kv_proj: the one key/value latent
        ("attention", per_group * d, a.o_lora_rank, touched),  # o_a, one per group
        ("attention", touched * a.o_lora_rank, h, 1),  # o_b
    ]
    if "compressor" in spec.parts:  # kv_proj (and gate_proj where it pools tokens)
        read.append(("attention", h, d, 2 if "compressor_gate" in spec.parts else 1))
    if "indexer" in spec.parts:  # q_b, weights_proj (and k_proj over the compressed latents)
        read += [
            ("attention", a.q_lora_rank, a.index_heads * a.index_head_dim, 1),
            ("attention", h, a.index_heads, 1),
        ]
        if "index_keys" in spec.parts:
            read.append(("attention", d, a.index_head_dim, 1))
    return read


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


def kv_bytes_per_token(spec: ModelSpec, shard: RankShard, float_bytes: int = FLOAT_BYTES) -> int:
    """KV cache bytes one layer of this rank adds per token of context (a layer view's:
    nothing where it reuses another layer's cache)."""
    if not spec.has_kv or spec.recurrent:  # a linear-attention layer: state_bytes instead
        return 0
    if spec.block in ("-", "E"):  # a Nemotron-H MLP or MoE layer: no attention
        return 0
    if spec.compressed_attention is not None:
        # A window of whole tokens (bounded, not per token) and, in the layers that compress,
        # one latent (and one index key) per compress_ratio tokens, on every rank with heads.
        if not shard.heads.q_heads.size or not spec.compress_ratio:
            return 0
        keys = spec.compressed_attention.index_head_dim if "index_keys" in spec.parts else 0
        return (spec.head_dim + keys) * float_bytes // spec.compress_ratio
    mla = spec.latent_attention
    if mla is None:
        return 2 * len(shard.heads.kv_heads) * spec.head_dim * float_bytes
    heads = shard.heads.q_heads.size
    if not heads:
        return 0
    if mla.latent_cache:  # the latent and the rope key, the same on every rank
        width = mla.kv_lora_rank + mla.rope_dim
    else:  # per-head keys (nope + rope) and values
        width = heads * (spec.head_dim + spec.head_width("v_head_dim"))
    return (width + 2 * mla.index_head_dim) * float_bytes


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
        key = (tuple(k for k, v in enumerate(spec.variants) if i in v.layers), moe, i in linear)
        key = (*key, spec.block_pattern[i] if spec.block_pattern else "")
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
        key = ("head", spec.hidden_size, spec.per_layer_embedding)
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


def _per_forward(
    plan: ShardPlan, layers: int, first: bool, last: bool
) -> list[tuple[Collective, int]]:
    """Each collective of a TP group over ``layers`` and how often it runs per forward."""
    counted = []
    for c in plan.collectives:
        if c.per_layer:
            times = c.per_layer * layers
        elif c.name in FIRST_STAGE_COLLECTIVES:
            times = int(first)
        elif c.name in LAST_STAGE_COLLECTIVES:
            times = int(last)
        else:
            times = 1
        if times:
            counted.append((c, times))
    return counted


def collective_count(plan: ShardPlan, layers: int, first: bool, last: bool) -> int:
    """Collectives a TP group runs per forward over ``layers``."""
    return sum(times for _, times in _per_forward(plan, layers, first, last))


def prefill_flops(load: RankLoad, tokens: int) -> float:
    """FLOPs of a prompt of ``tokens``: weights, plus causal attention scores and mixing."""
    return load.flops_per_token * tokens + 2.0 * load.attention_width * tokens * tokens


def all_sum_seconds(ranks: int, nbytes: float, link: LinkCost) -> float:
    if ranks < 2:
        return 0.0
    return (ranks - 1) * link.latency + 2 * (ranks - 1) / ranks * nbytes / link.bandwidth


def collective_floor(ranks: int, link: LinkCost, layer_overhead: float) -> float:
    """What each collective costs beyond its link model: the part of COLLECTIVE_OVERHEAD_LAYERS
    of a layer's overhead that the link's latency does not already account for."""
    if ranks < 2:
        return 0.0
    return max(0.0, COLLECTIVE_OVERHEAD_LAYERS * layer_overhead - (ranks - 1) * link.latency)


def all_gather_seconds(ranks: int, nbytes_per_rank: float, link: LinkCost) -> float:
    if ranks < 2:
        return 0.0
    return (ranks - 1) * (link.latency / 2 + nbytes_per_rank / link.bandwidth)


def hop_seconds(nbytes: float, receivers: int, link: LinkCost) -> float:
    return HOP_OVERHEAD + link.latency + receivers * nbytes / link.bandwidth


def collective_seconds(
    plan: ShardPlan,
    layers: int,
    first: bool,
    last: bool,
    link: LinkCost,
    tokens: int = 1,
    float_bytes: int = FLOAT_BYTES,
) -> float:
    """Seconds a TP group over ``layers`` spends in its collectives for ``tokens`` at once."""
    total = 0.0
    for c, times in _per_forward(plan, layers, first, last):
        # Logits are gathered for the last position only, prompt or not.
        payload = c.padded * float_bytes * (1 if c.name in LAST_STAGE_COLLECTIVES else tokens)
        one = (
            all_sum_seconds(plan.size, payload, link)
            if c.op == "all_sum"
            else all_gather_seconds(plan.size, payload, link)
        )
        total += times * one
    return total
