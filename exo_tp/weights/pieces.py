"""Bytes of one piece of a tensor: indices [start, stop) along its manifest axis, in C order.

A piece is ``outer`` contiguous runs (one per index of the axes before the split axis), each
``(stop - start) * run_unit`` bytes long, ``length * run_unit`` apart: a row slab is one run, a
column slab of a 2-D weight one run per row. The same layout is read from model files, written
into a shard store's files and checked block by block against the manifest's digests.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import numpy as np

from exo_tp.weights.manifest import TensorEntry, digest


def piece_bytes(entry: TensorEntry, start: int, stop: int) -> int:
    return (stop - start) * entry.unit_bytes


def _runs(entry: TensorEntry, path: Path, mode: Literal["r", "r+"]) -> np.memmap:
    """The tensor's bytes as (outer, length * run_unit), memory-mapped."""
    return np.memmap(
        path,
        dtype=np.uint8,
        mode=mode,
        offset=entry.offset,
        shape=(entry.outer, entry.length * entry.run_unit),
    )


def iter_piece(
    path: Path, entry: TensorEntry, start: int, stop: int, chunk: int = 1 << 20
) -> Iterator[bytes]:
    """The piece's bytes from ``path`` (a model file or a store file), in chunks of about
    ``chunk`` bytes; reads only the piece."""
    run = (stop - start) * entry.run_unit
    if run == 0:
        return
    if entry.outer == 1:  # one contiguous run: plain positioned reads
        with open(path, "rb") as f:
            pos, end = entry.offset + start * entry.run_unit, entry.offset + stop * entry.run_unit
            while pos < end:
                data = os.pread(f.fileno(), min(chunk, end - pos), pos)
                if not data:
                    raise OSError(f"{path} ends before {entry.name} does")
                pos += len(data)
                yield data
        return
    runs = _runs(entry, path, "r")
    step = max(1, chunk // run)
    lo, hi = start * entry.run_unit, stop * entry.run_unit
    for row in range(0, entry.outer, step):
        yield runs[row : row + step, lo:hi].tobytes()
    del runs


def read_piece(path: Path, entry: TensorEntry, start: int, stop: int) -> bytes:
    return b"".join(iter_piece(path, entry, start, stop))


def write_piece(path: Path, entry: TensorEntry, start: int, stop: int, data: bytes) -> None:
    """Write the piece's bytes at their place in ``path`` (a store file of the original
    layout), touching nothing else."""
    run = (stop - start) * entry.run_unit
    if len(data) != entry.outer * run:
        raise ValueError(
            f"{entry.name}[{start}:{stop}]: {len(data)} bytes, expected {entry.outer * run}"
        )
    if entry.outer == 1:
        with open(path, "r+b") as f:
            view, pos = memoryview(data), entry.offset + start * entry.run_unit
            while view:
                written = os.pwrite(f.fileno(), view, pos)
                view, pos = view[written:], pos + written
        return
    runs = _runs(entry, path, "r+")
    runs[:, start * entry.run_unit : stop * entry.run_unit] = np.frombuffer(
        data, dtype=np.uint8
    ).reshape(entry.outer, run)
    runs.flush()
    del runs


def bad_blocks(entry: TensorEntry, start: int, stop: int, data: bytes) -> list[int]:
    """Blocks of the piece whose bytes do not match the manifest's digests."""
    blocks = entry.blocks(start, stop)
    run = (stop - start) * entry.run_unit
    if len(data) != entry.outer * run:
        return list(blocks)
    array = np.frombuffer(data, dtype=np.uint8).reshape(entry.outer, run)
    bad = []
    for b in blocks:
        lo = (entry.cuts[b] - start) * entry.run_unit
        hi = (entry.cuts[b + 1] - start) * entry.run_unit
        part = memoryview(data)[lo:hi] if entry.outer == 1 else array[:, lo:hi].tobytes()
        if digest(part) != entry.digests[b]:
            bad.append(b)
    return bad
