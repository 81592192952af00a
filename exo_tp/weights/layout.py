"""Where a file tensor sits in an architecture's tensor-parallel table, and how it is cut (pure).

The loader (exo_tp.shard) reads each split weight as ranges along one axis: output rows of a
column-parallel weight (and of its scales, biases and bias), input columns of a row-parallel
one (packed quantized columns at c*bits/32, scales and biases at c/group), entries of a stacked
per-head weight, vocabulary rows of the embedding and LM head. Everything else is read whole.
This module names that axis for every tensor and the finest points any plan can cut it at, so
the manifest's digest blocks end exactly where a slice can (exo_tp.plan split_grains).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from exo_tp.arch import ArchTable, GroupedOutputRule, LinearRule, NormRule
from exo_tp.arch.dims import HEAD_DIMS, Dim
from exo_tp.arch.table import is_under
from exo_tp.plan.spec import ModelSpec
from exo_tp.plan.tensor_parallel import split_grains

# Parameters of a split module the loader slices (exo_tp.shard.slicing.SLICED_KEYS; that module
# imports MLX, this one must not).
SLICED_KEYS = ("weight", "scales", "biases", "bias")
QUANT_PARTS = ("weight", "scales", "biases")
# Blocks of a tensor that is only ever moved whole: about this many bytes each, so a corrupt
# or lost block costs little to fetch again.
WHOLE_BLOCK_BYTES = 1 << 20

Kind = Literal["rule", "grouped", "embedding", "lm_head", "vocab_table", "norm", "layer", "global"]


@dataclass(frozen=True)
class Place:
    """A tensor's place in the model: a split rule's parameter, a grouped output's inner stack
    or outer linear, the embedding or LM head, the final norm, another tensor of a layer, or
    another top-level tensor."""

    kind: Kind
    layer: int | None = None
    rule: LinearRule | None = None
    key: str | None = None  # weight/scales/biases/bias; None: the rule's path is the tensor
    grouped: GroupedOutputRule | None = None
    outer: bool = False  # of ``grouped``: the outer linear (else the inner stack)


def _under(name: str, prefix: str) -> str | None:
    """``name`` relative to ``prefix`` if it lies inside it."""
    return name[len(prefix) + 1 :] if name.startswith(f"{prefix}.") else None


def locate(name: str, table: ArchTable, has: Callable[[str], bool] | None = None) -> Place:
    """``has``: whether the model holds a module path, which decides the rules that apply
    only where a layer kind's module is (``Rule.where``); without it none of those apply."""
    if (rest := _under(name, table.layers)) is not None:
        index, _, inner = rest.partition(".")
        if index.isdigit():
            layer = int(index)
            for rule in table.linears:
                where = rule.where
                if where is not None and not (has and has(f"{table.layers}.{layer}.{where}")):
                    continue
                if inner == rule.path and rule.style == "stacked":
                    return Place(kind="rule", layer=layer, rule=rule)
                key = _under(inner, rule.path)
                if key in SLICED_KEYS:
                    return Place(kind="rule", layer=layer, rule=rule, key=key)
            for grouped in table.grouped_outputs:
                for outer, path in ((False, grouped.inner), (True, grouped.outer)):
                    if (key := _under(inner, path)) in QUANT_PARTS:
                        return Place(
                            kind="grouped", layer=layer, key=key, grouped=grouped, outer=outer
                        )
            for norm in table.norms:
                if _under(inner, norm.path) == "weight":
                    # a full-width norm's weight is cut like its projection's bias
                    return Place(kind="rule", layer=layer, rule=norm_rule(norm), key="bias")
            return Place(kind="layer", layer=layer)
    for kind, prefix in (("embedding", table.embedding), ("lm_head", table.lm_head)):
        if _under(name, prefix) in QUANT_PARTS:
            return Place(kind=kind)  # type: ignore[arg-type]
    for prefix in table.vocab_tables:  # token-indexed like the embedding, cut alike
        if _under(name, prefix) in QUANT_PARTS:
            return Place(kind="vocab_table")
    if is_under(name, table.norm):
        return Place(kind="norm")
    return Place(kind="global")


@functools.cache
def norm_rule(norm: NormRule) -> LinearRule:
    """The column rule whose bias is cut exactly as the sharded norm's weight (by heads)."""
    return LinearRule(path=norm.path, style="column", parts=(norm.dim,), width=norm.width)


def _dim_total(spec: ModelSpec, dim: Dim, width: int) -> int:
    if dim == Dim.Q_HEADS:
        return spec.num_heads * width
    if dim == Dim.KV_HEADS:
        return spec.num_kv_heads * width
    if dim == Dim.LINEAR_HEADS and spec.linear_attention is not None:
        return spec.linear_attention.num_heads * width
    return spec.ffn_sizes[dim]


@dataclass(frozen=True)
class Split:
    """How the loader may cut one tensor: along ``axis``; logical index i (row, column or head
    of the rule's packed dimension) is storage index ``i * ratio`` (bits/32 for packed quantized
    columns, 1/group for their scales and biases, else 1); ``points`` are the finest logical
    cut points of any plan."""

    axis: int
    total: int  # logical length along the axis
    ratio: Fraction
    points: tuple[int, ...]

    def storage(self, index: int) -> int:
        value = index * self.ratio
        if value.denominator != 1:
            raise ValueError(f"index {index} is not on a storage boundary (ratio {self.ratio})")
        return int(value)


def _rule_points(rule: LinearRule, spec: ModelSpec) -> tuple[int, tuple[int, ...]]:
    """(logical length of the packed axis, its finest cut points)."""
    grains = split_grains(spec)
    points: set[int] = {0}
    offset = 0
    for dim, width in zip(rule.parts, rule.part_widths(spec.head_width), strict=True):
        total = _dim_total(spec, dim, width)
        grain = grains[dim] * (width if dim in HEAD_DIMS else 1)
        points.update(offset + k for k in range(0, total, grain))
        offset += total
        points.add(offset)
    return offset, tuple(sorted(points))


def split_of(place: Place, shape: tuple[int, ...], spec: ModelSpec) -> Split | None:
    """The cut of a tensor the loader slices straight from its file, None if read whole."""
    if place.kind in ("embedding", "lm_head", "vocab_table"):
        if len(shape) < 2 or shape[-2] != spec.vocab_size:
            return None
        grain = split_grains(spec)[Dim.VOCAB]
        points = (*range(0, spec.vocab_size, grain), spec.vocab_size)
        return Split(axis=len(shape) - 2, total=spec.vocab_size, ratio=Fraction(1), points=points)
    if place.kind == "grouped":
        return _grouped_split(place, shape, spec)
    if place.kind != "rule" or not shape:
        return None
    rule = place.rule
    assert rule is not None
    if place.layer is not None:  # its layer's sizes (ModelSpec.variants)
        spec = spec.layer(place.layer)
    total, points = _rule_points(rule, spec)
    if rule.style == "stacked":
        axis = 0
    elif place.key == "bias":
        if rule.style == "row":
            return None  # the full output width: kept whole by one rank
        axis = len(shape) - 1
    else:
        if len(shape) < 2:
            return None
        axis = len(shape) - (2 if rule.style == "column" else 1)
    ratio = Fraction(shape[axis], total)
    if rule.style != "row" and ratio != 1:
        return None  # not the layout the table describes: the loader refuses it anyway
    if any((p * ratio).denominator != 1 for p in points):
        return None
    return Split(axis=axis, total=total, ratio=ratio, points=points)


def _grouped_split(place: Place, shape: tuple[int, ...], spec: ModelSpec) -> Split | None:
    """A grouped output is cut at its groups (exo_tp.shard.blocks: a rank reads the groups its
    heads touch): the inner stack along its groups, the outer linear's columns in groups of
    o_lora_rank (packed as quantized columns are)."""
    attention = spec.compressed_attention
    if attention is None or len(shape) < 2:
        return None
    groups = attention.o_groups
    if not place.outer:
        if len(shape) != 3 or shape[0] != groups:
            return None
        return Split(axis=0, total=groups, ratio=Fraction(1), points=tuple(range(groups + 1)))
    width = attention.o_lora_rank
    ratio = Fraction(shape[-1], groups * width)
    points = tuple(g * width for g in range(groups + 1))
    if any((p * ratio).denominator != 1 for p in points):
        return None
    return Split(axis=len(shape) - 1, total=groups * width, ratio=ratio, points=points)


def whole_cuts(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Block cuts along axis 0 of a tensor moved only whole (about WHOLE_BLOCK_BYTES each)."""
    rows = shape[0] if shape else 1
    row_bytes = itemsize * (math.prod(shape[1:]) if shape else 1)
    step = max(1, WHOLE_BLOCK_BYTES // max(1, row_bytes))
    return (*range(0, rows, step), rows) if rows else (0,)
