"""What one layer's attention of each special kind holds, reads and caches on a rank (pure):
multi-head latent attention (DeepSeek V2/V3 and kin, with DSA's indexer), recurrent linear
attention (Kimi Delta Attention, Gated DeltaNet, Mamba-2 via exo_tp.plan.mamba_cost, LFM2's
short convolutions) and DeepSeek V4.1's compressed attention; and every layer's KV cache.
exo_tp.plan.cost adds them up into a rank's load.
"""

from __future__ import annotations

from exo_tp.plan.mamba_cost import (
    mamba_floats,
    mamba_matrices,
    mamba_state_bytes,
    short_conv_floats,
    short_conv_matrices,
    short_conv_state_bytes,
)
from exo_tp.plan.matvec import Segment
from exo_tp.plan.profiles import FLOAT_BYTES
from exo_tp.plan.shard_plan import RankShard, Span
from exo_tp.plan.spec import CompressedAttention, LatentAttention, LinearAttention, ModelSpec


def latent_attention_matrices(
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
        read: list[tuple[Segment, int, int, int]] = [
            ("attention", h, mla.q_lora_rank, 1),
            ("attention", mla.q_lora_rank, heads * qk, 1),
        ]
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


def linear_attention_matrices(
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


def compressed_attention_matrices(
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
