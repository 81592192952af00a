"""The matvec shapes of one model's matrices that `exo-tp bench --model M` times.

A tensor-parallel split gives each rank a slice of the model's matrices: a slice of the FFN's
rows, of the attention heads, of the vocabulary. Their per-byte speed depends on the shape
(exo_tp.plan.matvec), so the bench times each matrix the model reads at decode at FRACTIONS
of its split dimension, and the planner interpolates between them for the slices a plan
gives. Shapes are rounded to the quantization group (a split never cuts one) and left out above
MAX_SHAPE_BYTES: the planner scales the largest measured one of their curve per byte up to
twice its size (`exo_tp.plan.matvec.MAX_EXTRAPOLATION`), and prices the rest by the decode score.
"""

from __future__ import annotations

from typing import NamedTuple

from exo_tp.plan.cost import bytes_per_weight, weight_format
from exo_tp.plan.spec import ModelSpec

FRACTIONS = tuple(j / 8 for j in range(1, 9))
MAX_SHAPE_BYTES = 256 * 2**20
_ALIGN = 8  # the smallest step a rounded dimension moves by


class ModelShapes(NamedTuple):
    """What `exo-tp bench --model` times: (k, n) shapes in one weight format."""

    dtype: str = ""
    shapes: tuple[tuple[int, int], ...] = ()


NO_SHAPES = ModelShapes()  # a bench without --model


def _slices(width: int, unit: int) -> set[int]:
    """``width`` at each of FRACTIONS, rounded to a multiple of ``unit`` (at least one unit,
    at most ``width``)."""
    step = max(unit, _ALIGN)
    return {min(width, max(step, round(width * f / step) * step)) for f in FRACTIONS}


def model_shapes(spec: ModelSpec) -> ModelShapes:
    """The weight format and sorted (k, n) shapes of ``spec``'s matrices and their slices: every
    matrix reads x (k) into y (n) with the hidden size on one side."""
    h, unit = spec.hidden_size, spec.input_align
    q_width, kv_width = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    ffn = [_slices(width, unit) for width in spec.ffn_sizes.values()]
    # q_proj, k_proj/v_proj, gate/up, the LM head's vocabulary; the MoE router is never split
    outputs = set().union(
        _slices(q_width, unit), _slices(kv_width, unit), *ffn, _slices(spec.vocab_size, unit)
    ) | ({spec.num_experts} if spec.num_experts else set())
    inputs = set().union(_slices(q_width, unit), *ffn)  # o_proj, down
    per = bytes_per_weight(spec)
    shapes = {(h, n) for n in outputs} | {(k, h) for k in inputs}
    kept = sorted(s for s in shapes if s[0] * s[1] * per <= MAX_SHAPE_BYTES)
    return ModelShapes(weight_format(spec), tuple(kept))
