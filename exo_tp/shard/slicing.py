"""Replace a lazily loaded module's weights by one rank's slices, read straight from disk.

Handles float and affine-quantized linears of every mlx-lm flavour alike (Linear,
QuantizedLinear, stacked experts (E, out, in), MLA's per-head stacks (heads, out, in)) and bare
parameters: output rows and leading axes may be cut anywhere; input columns of a quantized
weight only on quantization-group boundaries (packed weight at c*bits/32, scales and biases at
c/group), so slices are bit-exact and nothing is ever requantized.
"""

from __future__ import annotations

import copy
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from exo_tp.errors import ExoTpError
from exo_tp.shard.safetensors_slices import Ranges, SafetensorsIndex

QUANT_PARTS = ("weight", "scales", "biases")
SLICED_KEYS = (*QUANT_PARTS, "bias")


class ShardError(RuntimeError):
    """A slice the plan should never ask for (a bug, caught before a wrong result)."""


class WeightSlicer:
    """Slices of a model's parameters, from the safetensors files where they are stored as is."""

    def __init__(self, model_dir: Path, model: nn.Module):
        self.files = SafetensorsIndex(model_dir)
        # Parameters that sanitize() leaves untouched are file tensors we may slice on disk.
        raw: dict[str, mx.array] = {}
        for path in sorted(Path(model_dir).glob("*.safetensors")):
            raw.update(mx.load(str(path)))
        # On a copy: some sanitize() methods also edit the model (gemma3 drops a tied lm_head).
        sanitize = getattr(copy.copy(model), "sanitize", None)
        sanitized = sanitize(dict(raw)) if sanitize else raw
        self.direct = {k for k, v in sanitized.items() if raw.get(k) is v}

    def take(self, name: str, array: mx.array, axis: int, ranges: Ranges) -> mx.array:
        if name in self.direct and self.files.matches(name, array):
            return self.files.read(name, axis, ranges)
        parts = [mx.take(array, mx.arange(a, b), axis=axis) for a, b in ranges]
        if not parts:
            shape = list(array.shape)
            shape[axis] = 0
            return mx.zeros(shape, dtype=array.dtype)
        return mx.contiguous(mx.concatenate(parts, axis=axis))

    def slice_rows(self, name: str, module: nn.Module, ranges: Ranges, expected: int) -> None:
        """Column-parallel: keep output rows (and their scales, biases and bias)."""
        _check_length(name, "output rows", module["weight"].shape[-2], expected)
        for key in _keys(name, module):
            axis = -1 if key == "bias" else -2
            module[key] = self.take(f"{name}.{key}", module[key], axis, ranges)

    def slice_columns(
        self, name: str, module: nn.Module, ranges: Ranges, expected: int, keep_bias: bool
    ) -> None:
        """Row-parallel: keep input columns; packed quantized columns scale by bits/32.

        The bias (full output width) stays on one rank only (``keep_bias``), so the all-reduce
        of the enclosing branch adds it exactly once.
        """
        keys = _keys(name, module)
        quantized = "scales" in module
        group = module.group_size if quantized else 1
        packed = module["weight"].shape[-1]
        in_dims = packed * 32 // module.bits if quantized else packed
        _check_length(name, "input columns", in_dims, expected)
        if any(a % group or b % group for a, b in ranges):
            raise ShardError(f"{name}: input columns {ranges} cut quantization groups of {group}")
        for key in keys:
            if key == "bias":
                if not keep_bias:
                    module.pop("bias")
                continue
            if not quantized:
                num, den = 1, 1
            elif key == "weight":
                num, den = module.bits, 32
            else:
                num, den = 1, group
            cut = [(a * num // den, b * num // den) for a, b in ranges]
            module[key] = self.take(f"{name}.{key}", module[key], -1, cut)

    def slice_leading(
        self, name: str, owner: nn.Module, key: str, ranges: Ranges, expected: int
    ) -> None:
        """A per-head stack: keep entries of axis 0 (of a bare parameter, or of every part
        of a module's weight)."""
        value = owner[key]
        if isinstance(value, mx.array):
            _check_length(name, "heads", value.shape[0], expected)
            owner[key] = self.take(name, value, 0, ranges)
            return
        _check_length(name, "heads", value["weight"].shape[0], expected)
        for part in _keys(name, value):
            value[part] = self.take(f"{name}.{part}", value[part], 0, ranges)


def _keys(name: str, module: nn.Module) -> list[str]:
    unknown = [k for k, v in module.items() if isinstance(v, mx.array) and k not in SLICED_KEYS]
    if unknown:
        raise ExoTpError(f"{name}: cannot split parameters {unknown} (unsupported quantization?)")
    return [k for k in SLICED_KEYS if isinstance(module.get(k), mx.array)]


def _check_length(name: str, what: str, actual: int, expected: int) -> None:
    if actual != expected:
        raise ExoTpError(f"{name} has {actual} {what} but config.json implies {expected}")
