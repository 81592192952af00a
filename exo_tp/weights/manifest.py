"""A model's weight manifest: what every tensor is, where its bytes are, and their digests (pure
data; exo_tp.weights.build computes it from a model folder).

A tensor is cut along one axis (``TensorEntry.axis``: the axis the loader slices it on, axis 0
for tensors only ever read whole) into digest blocks at ``cuts``. A block is the C-order bytes
of ``tensor[..., cuts[i]:cuts[i+1], ...]`` (full extent on every other axis), so a slice the
loader reads (whole blocks, by construction of the cuts) is verified block by block, whether it
is a run of rows or of (packed) columns.
"""

from __future__ import annotations

import hashlib
import math
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterable
from functools import cached_property

from pydantic import Field

from exo_tp.frozen import Frozen
from exo_tp.weights.ranges import Ranges
from exo_tp.wire.ids import ModelIdentity

MANIFEST_VERSION = 1
DIGEST_BYTES = 16  # truncated SHA-256: hardware-accelerated on x86 (SHA-NI) and Apple silicon

# Bytes per element of each safetensors dtype exo-tp can move.
# A file name inside the model folder: no directories, nothing hidden (stores write these names).
FILE_NAME = r"^[^/\\.][^/\\]*$"

ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "U64": 8,
    "I32": 4,
    "U32": 4,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


def digest(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()[: 2 * DIGEST_BYTES]


class TensorEntry(Frozen):
    name: str
    file: str = Field(pattern=FILE_NAME)  # file name inside the model folder
    offset: int = Field(ge=0)  # absolute byte offset of the data in the file
    dtype: str
    shape: tuple[int, ...]
    # The loader may read slices straight from the file (model.sanitize() leaves it as is and
    # the model has a parameter of that name and shape); otherwise it is only moved whole.
    sliceable: bool
    axis: int = Field(ge=0)  # 0 for a 0-d tensor (one block of one "row")
    cuts: tuple[int, ...]  # block boundaries along axis: 0 = cuts[0] < ... < cuts[-1] = length
    digests: tuple[str, ...]  # one per block

    @cached_property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @cached_property
    def length(self) -> int:
        """Indices along the axis."""
        return self.shape[self.axis] if self.shape else 1

    @cached_property
    def unit_bytes(self) -> int:
        """Bytes of one index along the axis (over every other axis)."""
        return self.nbytes // self.length if self.length else 0

    @cached_property
    def nbytes(self) -> int:
        return self.itemsize * math.prod(self.shape)

    @cached_property
    def outer(self) -> int:
        """Contiguous runs a slab along the axis is made of (product of the earlier axes)."""
        return math.prod(self.shape[: self.axis])

    @cached_property
    def run_unit(self) -> int:
        """Bytes of one index along the axis inside one run (product of the later axes)."""
        return self.itemsize * math.prod(self.shape[self.axis + 1 :])

    def bytes_of(self, ranges: Ranges) -> int:
        return sum(b - a for a, b in ranges) * self.unit_bytes

    def blocks(self, start: int, stop: int) -> range:
        """Indices of the blocks that exactly tile [start, stop); ValueError if it cuts one."""
        first, last = bisect_left(self.cuts, start), bisect_left(self.cuts, stop)
        if (
            first == len(self.cuts)
            or self.cuts[first] != start
            or last == len(self.cuts)
            or self.cuts[last] != stop
            or stop < start
        ):
            raise ValueError(f"{self.name}: [{start}, {stop}) is not whole digest blocks")
        return range(first, last)


class WeightFile(Frozen):
    name: str = Field(pattern=FILE_NAME)
    size: int = Field(ge=0)
    # The file's raw JSON header: a shard store writes it back byte for byte, so every tensor
    # keeps its offset and the store's files read like the originals.
    header: str
    digest: str  # SHA-256 of the whole file


class ExtraFile(Frozen):
    """A small file besides the weights (config.json, tokenizer files): moved whole."""

    name: str = Field(pattern=FILE_NAME)
    size: int = Field(ge=0)
    digest: str  # SHA-256 of the whole file


def module_paths(parameters: Iterable[str]) -> frozenset[str]:
    """Every dotted prefix of the parameter names: the modules (and parameters) that exist."""
    out: set[str] = set()
    for name in parameters:
        parts = name.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return frozenset(out)


class ModelManifest(Frozen):
    version: int = MANIFEST_VERSION
    # SHA-256 over config.json, every tensor's name, dtype and shape, and every file's digest.
    identity: ModelIdentity
    model_type: str
    weight_files: tuple[WeightFile, ...]
    extra_files: tuple[ExtraFile, ...]
    tensors: tuple[TensorEntry, ...]
    # The model's parameter names as mlx-lm builds it (after sanitize and quantization): which
    # modules exist, whether the embedding is tied; exo_tp.weights.boxes follows them.
    parameters: tuple[str, ...]

    @cached_property
    def by_name(self) -> dict[str, TensorEntry]:
        return {t.name: t for t in self.tensors}

    def tensor(self, name: str) -> TensorEntry:
        return self.by_name[name]

    @cached_property
    def parameter_set(self) -> frozenset[str]:
        return frozenset(self.parameters)

    @cached_property
    def module_paths(self) -> frozenset[str]:
        """Every dotted prefix of a parameter name: the modules (and parameters) that exist."""
        return module_paths(self.parameters)

    def has(self, path: str) -> bool:
        return path in self.module_paths

    @cached_property
    def numbered(self) -> dict[tuple[str, int], tuple[str, ...]]:
        """Parameters inside numbered modules ("model.layers", 3) -> their paths inside it."""
        groups: dict[tuple[str, int], list[str]] = defaultdict(list)
        for name in self.parameters:
            parts = name.split(".")
            index = next((i for i, p in enumerate(parts) if p.isdigit()), None)
            if index is not None:
                key = (".".join(parts[:index]), int(parts[index]))
                groups[key].append(".".join(parts[index + 1 :]))
        return {k: tuple(v) for k, v in groups.items()}

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)
