"""A quantized KV cache's width and who may have one (pure: no MLX).

mlx-lm's ``QuantizedKVCache`` stores keys and values as ``mx.quantize`` does, in groups of
``group_size`` along the head width: per element ``bits / 8`` bytes of packed integers plus one
scale and one bias per group in the activations' dtype. A rank quantizes the KV of its own heads,
so a rank's quantized KV bytes are its float KV bytes at that width. Which models cannot have
one is decided here too, so `exo-tp launch`, a node's leader and a rank give the same reason.
"""

from __future__ import annotations

from exo_tp.plan.spec import ModelSpec

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
