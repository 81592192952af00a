"""Read only the wanted slices of tensors stored in .safetensors files.

`mx.load` is lazy per tensor, but evaluating a slice of a lazily loaded tensor still reads (and
briefly holds) the whole tensor. Reading the byte ranges ourselves keeps each rank's peak memory
at its share. The `safetensors` package can slice too, but only through numpy, which has no
bfloat16; here every dtype is read as raw unsigned integers of its width and viewed in MLX.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

_DTYPES: dict[str, tuple[np.dtype, mx.Dtype]] = {
    "F32": (np.dtype("<u4"), mx.float32),
    "F16": (np.dtype("<u2"), mx.float16),
    "BF16": (np.dtype("<u2"), mx.bfloat16),
    "U32": (np.dtype("<u4"), mx.uint32),
    "I32": (np.dtype("<u4"), mx.int32),
    "U8": (np.dtype("<u1"), mx.uint8),
    "I8": (np.dtype("<u1"), mx.int8),
    "U16": (np.dtype("<u2"), mx.uint16),
    "I64": (np.dtype("<u8"), mx.int64),
    "U64": (np.dtype("<u8"), mx.uint64),
}

Ranges = Sequence[tuple[int, int]]


class _Entry:
    __slots__ = ("path", "dtype", "shape", "offset")

    def __init__(self, path: Path, dtype: str, shape: tuple[int, ...], offset: int):
        self.path, self.dtype, self.shape, self.offset = path, dtype, shape, offset


class SafetensorsIndex:
    """Headers of every ``*.safetensors`` file in a model folder, for slice reads by name."""

    def __init__(self, model_dir: Path):
        self.entries: dict[str, _Entry] = {}
        for path in sorted(Path(model_dir).glob("*.safetensors")):
            with open(path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
            for name, info in header.items():
                if name == "__metadata__" or info["dtype"] not in _DTYPES:
                    continue
                start, _ = info["data_offsets"]
                self.entries[name] = _Entry(
                    path, info["dtype"], tuple(info["shape"]), 8 + header_len + start
                )

    def matches(self, name: str, array: mx.array) -> bool:
        """Whether ``name`` in the files is exactly this (lazily loaded) parameter."""
        entry = self.entries.get(name)
        return (
            entry is not None
            and entry.shape == tuple(array.shape)
            and _DTYPES[entry.dtype][1] == array.dtype
        )

    def read(self, name: str, axis: int | None = None, ranges: Ranges = ()) -> mx.array:
        """The tensor, or only ``ranges`` of it along ``axis``, as a contiguous MLX array."""
        entry = self.entries[name]
        raw_dtype, mx_dtype = _DTYPES[entry.dtype]
        if 0 in entry.shape:
            return mx.zeros(entry.shape, dtype=mx_dtype)
        mapped = np.memmap(
            entry.path, dtype=raw_dtype, mode="r", offset=entry.offset, shape=entry.shape
        )
        data = np.array(mapped) if axis is None else take_ranges(mapped, axis, ranges)
        del mapped  # unmap now: the copy is all we keep
        return mx.array(data).view(mx_dtype)


def take_ranges(array: np.ndarray, axis: int, ranges: Ranges) -> np.ndarray:
    """Concatenation of ``array[..., a:b, ...]`` along ``axis`` for each range (a new array)."""
    axis = axis % array.ndim
    parts = [array[(slice(None),) * axis + (slice(a, b),)] for a, b in ranges]
    if not parts:
        shape = list(array.shape)
        shape[axis] = 0
        return np.zeros(shape, dtype=array.dtype)
    return np.ascontiguousarray(np.concatenate(parts, axis=axis))
