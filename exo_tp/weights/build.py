"""Compute a model folder's manifest once, on the node that has the files, and cache it.

Cache: ``<exo-tp cache>/manifests/<hash of the folder's path>.json`` (``$EXO_TP_HOME`` or
``~/.cache/exo-tp``), holding the manifest and the name, size and modification time of every
file it covers. Any change (a file added, removed, rewritten or touched) or a new manifest
version recomputes it. Hashing reads every byte once per digest kind (blocks and whole files)
with one thread per core: hashlib releases the GIL.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from exo_tp.arch import table_for
from exo_tp.atomic_file import write_atomically
from exo_tp.errors import ExoTpError
from exo_tp.frozen import Frozen, replace
from exo_tp.paths import cache_home
from exo_tp.plan.spec import load_spec
from exo_tp.weights.describe import describe
from exo_tp.weights.manifest import (
    ITEMSIZE,
    MANIFEST_VERSION,
    ExtraFile,
    ModelManifest,
    TensorEntry,
    WeightFile,
    digest,
    module_paths,
)
from exo_tp.wire.ids import ModelIdentity

log = logging.getLogger(__name__)

WEIGHT_SUFFIX = ".safetensors"
# Other weight formats are never extra files (a folder converted from them may keep them).
SKIPPED_SUFFIXES = (".gguf", ".bin", ".pt", ".pth", ".npz", ".h5", ".ckpt", ".onnx", ".msgpack")
EXTRA_MAX_BYTES = 64 << 20


class FileStamp(Frozen):
    name: str
    size: int
    mtime_ns: int


class CachedManifest(Frozen):
    folder: str
    stamps: tuple[FileStamp, ...]
    manifest: ModelManifest


def _weight_paths(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"*{WEIGHT_SUFFIX}"))  # as exo_tp.shard.SafetensorsIndex


def _extra_paths(folder: Path) -> list[Path]:
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file()
        and not p.name.startswith(".")
        and not p.name.endswith((WEIGHT_SUFFIX, *SKIPPED_SUFFIXES))
        and p.stat().st_size <= EXTRA_MAX_BYTES
    )


def stamps(folder: Path) -> tuple[FileStamp, ...]:
    out = []
    for path in [*_weight_paths(folder), *_extra_paths(folder)]:
        st = path.stat()
        out.append(FileStamp(name=path.name, size=st.st_size, mtime_ns=st.st_mtime_ns))
    return tuple(out)


def read_header(path: Path) -> tuple[str, dict]:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        raw = f.read(length)
    try:
        return raw.decode("utf-8"), json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as bad:
        raise ExoTpError(f"{path} is not a safetensors file: {bad}") from None


def file_digest(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    buffer = bytearray(chunk)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            h.update(memoryview(buffer)[:n])
    return h.hexdigest()


def block_digests(path: Path, entry: TensorEntry) -> tuple[str, ...]:
    """Digest of each block's C-order bytes (see exo_tp.weights.manifest)."""
    if not entry.nbytes:
        return tuple(digest(b"") for _ in entry.cuts[1:])
    runs = np.memmap(
        path,
        dtype=np.uint8,
        mode="r",
        offset=entry.offset,
        shape=(entry.outer, entry.length * entry.run_unit),
    )
    out = []
    for a, b in zip(entry.cuts, entry.cuts[1:], strict=False):
        block = runs[:, a * entry.run_unit : b * entry.run_unit]
        out.append(digest(block.data if entry.outer == 1 else block.tobytes()))
    del runs
    return tuple(out)


def _entries(
    folder: Path, parameters: tuple[str, ...], sliceable: frozenset[str]
) -> tuple[list[WeightFile], list[TensorEntry]]:
    spec = load_spec(folder)
    table = table_for(spec.model_type)
    modules = module_paths(parameters)  # which layer kind each layer is (Rule.where)
    files, entries = [], []
    for path in _weight_paths(folder):
        text, header = read_header(path)
        base = 8 + len(text.encode("utf-8"))
        files.append(WeightFile(name=path.name, size=path.stat().st_size, header=text, digest=""))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in ITEMSIZE:
                raise ExoTpError(
                    f"{path.name}: tensor {name} has dtype {info['dtype']}, which "
                    f"exo-tp cannot move"
                )
            entries.append(
                describe(
                    name,
                    path.name,
                    base + info["data_offsets"][0],
                    info["dtype"],
                    tuple(info["shape"]),
                    name in sliceable,
                    spec,
                    table,
                    modules.__contains__,
                )
            )
    return files, entries


def build_manifest(folder: Path, threads: int | None = None) -> ModelManifest:
    """Read every weight byte of ``folder`` once per digest kind and describe it."""
    from exo_tp.weights.structure import model_structure  # MLX: only here

    folder = Path(folder)
    if not _weight_paths(folder):
        raise ExoTpError(f"{folder} has no *{WEIGHT_SUFFIX} files")
    parameters, sliceable = model_structure(folder)
    files, entries = _entries(folder, parameters, sliceable)
    extras = _extra_paths(folder)
    with ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:
        blocks = pool.map(lambda e: block_digests(folder / e.file, e), entries)
        whole = pool.map(file_digest, [folder / f.name for f in files])
        extra_digests = pool.map(file_digest, extras)
        entries = [replace(e, digests=d) for e, d in zip(entries, blocks, strict=True)]
        files = [replace(f, digest=d) for f, d in zip(files, whole, strict=True)]
        extra = [
            ExtraFile(name=p.name, size=p.stat().st_size, digest=d)
            for p, d in zip(extras, extra_digests, strict=True)
        ]
    config = folder / "config.json"
    identity = ModelIdentity(
        hashlib.sha256(
            json.dumps(
                {
                    "config": file_digest(config),
                    "tensors": [[e.name, e.dtype, list(e.shape)] for e in entries],
                    "files": [[f.name, f.digest] for f in files],
                }
            ).encode()
        ).hexdigest()
    )
    return ModelManifest(
        identity=identity,
        model_type=load_spec(folder).model_type,
        weight_files=tuple(files),
        extra_files=tuple(extra),
        tensors=tuple(entries),
        parameters=parameters,
    )


def cache_path(folder: Path, cache: Path | None = None) -> Path:
    key = hashlib.sha256(str(Path(folder).resolve()).encode()).hexdigest()[:24]
    return (cache or cache_home() / "manifests") / f"{key}.json"


def manifest_for(folder: Path, cache: Path | None = None) -> ModelManifest:
    """The folder's manifest, from the cache when no file changed since it was computed."""
    folder = Path(folder).resolve()
    path = cache_path(folder, cache)
    now = stamps(folder)
    try:
        cached = CachedManifest.model_validate_json(path.read_text())
        if (
            cached.folder == str(folder)
            and cached.stamps == now
            and cached.manifest.version == MANIFEST_VERSION
        ):
            return cached.manifest
    except (OSError, ValueError):
        pass  # absent, unreadable or from another version: recompute
    log.info("computing the weight manifest of %s", folder)
    manifest = build_manifest(folder)
    if stamps(folder) != now:
        raise ExoTpError(f"{folder} changed while its manifest was computed; try again")
    cached = CachedManifest(folder=str(folder), stamps=now, manifest=manifest)
    write_atomically(path, cached.model_dump_json())
    return manifest
