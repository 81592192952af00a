"""Replace a lazily loaded module's weights by one rank's slices, read straight from disk.

Handles float and affine-quantized linears of every mlx-lm flavour alike (Linear,
QuantizedLinear, stacked experts (E, out, in), MLA's per-head stacks (heads, out, in)) and bare
parameters: output rows and leading axes may be cut anywhere; input columns of a quantized
weight only on quantization-group boundaries (packed weight at c*bits/32, scales and biases at
c/group), so slices are bit-exact and nothing is ever requantized.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import _get_classes, load_model

from exo_tp.errors import ExoTpError
from exo_tp.shard.safetensors_slices import Ranges, SafetensorsIndex

QUANT_PARTS = ("weight", "scales", "biases")
SLICED_KEYS = (*QUANT_PARTS, "bias")


class ShardError(RuntimeError):
    """A slice the plan should never ask for (a bug, caught before a wrong result)."""


class WeightSlicer:
    """Slices of a model's parameters, from the safetensors files where they are stored as is.

    ``direct``: the file tensors mlx-lm's own load (sanitize() included) loaded unchanged, the only
    ones that may be read straight from the files (load_lazily records them).
    """

    def __init__(self, model_dir: Path, direct: Iterable[str]):
        self.files = SafetensorsIndex(model_dir)
        self.direct = frozenset(direct)

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
        for key in sliced_keys(name, module):
            axis = -1 if key == "bias" else -2
            module[key] = self.take(f"{name}.{key}", module[key], axis, ranges)

    def slice_columns(
        self, name: str, module: nn.Module, ranges: Ranges, expected: int, keep_bias: bool
    ) -> None:
        """Row-parallel: keep input columns; packed quantized columns scale by bits/32.

        The bias (full output width) stays on one rank only (``keep_bias``), so the all-reduce
        of the enclosing branch adds it exactly once.
        """
        keys = sliced_keys(name, module)
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
        for part in sliced_keys(name, value):
            value[part] = self.take(f"{name}.{part}", value[part], 0, ranges)


def load_lazily(model_dir: Path) -> tuple[nn.Module, dict[str, Any], WeightSlicer]:
    """mlx-lm's own load_model (lazy: nothing is read), and a slicer for what it loaded.

    sanitize() is not a pure function of the weights: some architectures also edit the model in
    it (gemma3_text removes its lm_head module when the file has none), so it must run once, on
    the freshly built model, exactly where mlx-lm runs it (before quantization and loading).
    Rather than calling it again, the model class is wrapped so that mlx-lm's own calls record
    which file tensors reach load_weights unchanged (through sanitize and any later rewrite,
    such as AWQ repacking): those alone may be sliced on disk.
    """
    loaded: dict[str, mx.array] = {}
    direct: set[str] = set()

    def classes(config: dict[str, Any]) -> tuple[type[nn.Module], type]:
        model_class, args_class = _get_classes(config)
        original = getattr(model_class, "sanitize", None)

        def sanitize(self: nn.Module, weights: dict[str, mx.array]) -> dict[str, mx.array]:
            loaded.update(weights)  # before: some sanitize() edit the dict in place
            return original(self, weights) if original is not None else weights

        def load_weights(self: nn.Module, file_or_weights: Any, strict: bool = True) -> nn.Module:
            if loaded and isinstance(file_or_weights, list):  # load_model's one call
                direct.update(k for k, v in file_or_weights if loaded.get(k) is v)
                loaded.clear()
            return model_class.load_weights(self, file_or_weights, strict=strict)

        recording = type(
            model_class.__name__,
            (model_class,),
            {
                "sanitize": sanitize,
                "load_weights": load_weights,
                "__module__": model_class.__module__,
            },
        )
        return recording, args_class

    model, config = load_model(Path(model_dir), lazy=True, get_model_classes=classes)
    return model, config, WeightSlicer(Path(model_dir), direct)


def sliced_keys(name: str, module: nn.Module) -> list[str]:
    unknown = [k for k, v in module.items() if isinstance(v, mx.array) and k not in SLICED_KEYS]
    if unknown:
        raise ExoTpError(f"{name}: cannot split parameters {unknown} (unsupported quantization?)")
    return [k for k in SLICED_KEYS if isinstance(module.get(k), mx.array)]


def _check_length(name: str, what: str, actual: int, expected: int) -> None:
    if actual != expected:
        raise ExoTpError(f"{name} has {actual} {what} but config.json implies {expected}")
