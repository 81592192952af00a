"""A quantized KV cache's width and who may have one (pure: no MLX).

mlx-lm's ``QuantizedKVCache`` stores keys and values as ``mx.quantize`` does, in groups of
``group_size`` along the head width: per element ``bits / 8`` bytes of packed integers plus one
scale and one bias per group in the activations' dtype. A rank quantizes the KV of its own heads,
so a rank's quantized KV bytes are its float KV bytes at that width. Which models cannot have
one is decided here too, so `exo-tp launch`, a node's leader and a rank give the same reason.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from exo_tp.frozen import Frozen
from exo_tp.plan.cost import rank_load, stage_kv_bytes_per_token, stage_state_bytes
from exo_tp.plan.pipeline import PipelinePlan
from exo_tp.plan.spec import ModelSpec


class KvShape(Frozen):
    """What the KV cache is planned for: its width and how many streams hold a context at
    once (each the planned context long)."""

    bits: int | None = None  # None: float
    group_size: int = Field(default=64, gt=0)
    streams: int = Field(default=1, ge=1)


FLOAT_KV = KvShape()  # float, one stream: the planner's default

KV_BITS = (2, 3, 4, 5, 6, 8)  # mx.quantize's affine widths
KV_GROUP_SIZES = (32, 64, 128)  # mx.quantize's group sizes


def kv_element_bytes(float_bytes: int, bits: int | None, group_size: int = 64) -> float:
    """Bytes one cached key or value element takes: the float width, or quantized its packed
    bits plus its share of its group's scale and bias (both in the float dtype)."""
    if bits is None:
        return float(float_bytes)
    return bits / 8 + 2 * float_bytes / group_size


def kv_bytes_at_width(
    float_kv_bytes: int, float_bytes: int, bits: int | None, group_size: int = 64
) -> int:
    """``float_kv_bytes`` (a cost.kv_bytes_per_token sum at ``float_bytes`` per element) at the
    quantized width: every KV element scales alike."""
    if bits is None:
        return float_kv_bytes
    return round(float_kv_bytes * kv_element_bytes(float_bytes, bits, group_size) / float_bytes)


def kv_quantization_problem(spec: ModelSpec, bits: int | None, group_size: int) -> str | None:
    """Why this model cannot keep a quantized KV cache of ``group_size`` (None: it can). The
    cache kinds a model builds at run time (sliding windows) are checked by the rank
    (exo_tp.shard.kv_quant), which knows them."""
    if bits is None:
        return None
    if bits not in KV_BITS:
        return f"--kv-bits {bits}: choose one of {', '.join(map(str, KV_BITS))}"
    if group_size not in KV_GROUP_SIZES:
        return f"--kv-group-size {group_size}: choose one of 32, 64, 128"
    if spec.latent_attention is not None or spec.compressed_attention is not None:
        return (
            f"--kv-bits: {spec.model_type}'s latent KV cache is read outside attention "
            "(mlx-lm has no quantized form of it)"
        )
    widths = {spec.head_dim, *(v.head_dim for v in spec.variants if v.head_dim)}
    widths |= {w for k, w in spec.head_widths.items() if k == "v_head_dim"}
    for width in sorted(widths):
        if width % group_size:
            fits = [g for g in KV_GROUP_SIZES if width % g == 0]
            hint = f": use --kv-group-size {fits[-1]}" if fits else ""
            return (
                f"--kv-group-size {group_size} does not divide {spec.model_type}'s head width "
                f"{width} (KV is quantized in groups along it){hint}"
            )
    return None


def rank_kv_bytes_per_token(
    plan: PipelinePlan, rank: int, float_bytes: int, bits: int | None, group_size: int = 64
) -> int:
    """KV bytes global rank ``rank`` adds per token of one stream's context, at the width."""
    index, local = plan.locate(rank)
    stage = plan.stages[index]
    floats = stage_kv_bytes_per_token(plan.spec, stage.tp.ranks[local], stage.layers, float_bytes)
    return kv_bytes_at_width(floats, float_bytes, bits, group_size)


def tokens_beside_weights(
    memory: int,
    weights: int,
    kv_per_token: int,
    state: int = 0,
    streams: int = 1,
    cap_bytes: int | None = None,
) -> int | None:
    """Tokens of context, all ``streams`` together, that one rank's ``memory`` holds beside its
    ``weights`` and each stream's recurrent ``state`` (hybrid families keep a few MB per stream
    whatever the context), or at most ``cap_bytes`` of KV, at ``kv_per_token`` bytes each.
    None: the rank's KV does not grow with the context. The planner (RankMemory.context_fits)
    and the leader's admission (kv_token_capacity) both count with this one function, so the
    leader never admits more than the plan says fits."""
    if kv_per_token <= 0:
        return None
    room = memory - weights - state * streams
    if cap_bytes is not None:  # the cap bounds the KV cache; the state is held apart from it
        room = min(room, cap_bytes)
    return max(0, room) // kv_per_token


def kv_token_capacity(
    plan: PipelinePlan,
    free: Sequence[int],
    float_bytes: int,
    bits: int | None,
    group_size: int = 64,
    cap_bytes: int | None = None,
    streams: int = 1,
) -> int | None:
    """Tokens of context, all streams together, that every rank's KV cache holds: each rank's
    ``free`` memory (the bytes its device lets a plan fill) less the weights it holds and the
    recurrent state of ``streams`` streams (as many as one batch runs), or at most
    ``cap_bytes`` of KV, over its KV bytes per token; the fullest rank decides. None: no rank
    keeps a KV cache that grows with the context."""
    tokens = []
    for index, stage in enumerate(plan.stages):
        first, last = index == 0, index == len(plan.stages) - 1
        for local, rank in enumerate(stage.ranks):
            shard = stage.tp.ranks[local]
            fit = tokens_beside_weights(
                free[rank],
                rank_load(plan.spec, shard, stage.layers, first, last).held_bytes,
                rank_kv_bytes_per_token(plan, rank, float_bytes, bits, group_size),
                stage_state_bytes(plan.spec, shard, stage.layers, float_bytes),
                streams,
                cap_bytes,
            )
            if fit is not None:
                tokens.append(fit)
    return min(tokens) if tokens else None
