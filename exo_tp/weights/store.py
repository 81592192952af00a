"""A node's shard store: the boxes it received, kept on disk as a model folder the loader reads.

The store mirrors the model folder: the small extra files (config.json, tokenizer files) whole,
and every ``*.safetensors`` file with its original header and size, as a *sparse* file in which
only the received pieces are written (the holes take no disk space on APFS, ext4, XFS, btrfs).
Every tensor keeps its offset, so ``load_shard(store.folder, ...)`` reads its slices exactly as
from the original folder, and mlx-lm builds the model from the same config and headers. Pieces
are written slice by slice at their place (never a whole tensor), after their block digests
matched the manifest, and recorded in a journal, so a store survives restarts of the worker and
of the node, and serves its boxes to peers (from the page cache, usually).

Only recorded boxes are ever served or trusted: a hole reads as zeros, so callers check
``missing`` before loading (the pieces of a loader's reads are exactly rank_boxes).
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from exo_tp.atomic_file import write_atomically
from exo_tp.errors import ExoTpError
from exo_tp.frozen import Frozen
from exo_tp.paths import cache_home
from exo_tp.weights import ranges as R
from exo_tp.weights.boxes import Boxes
from exo_tp.weights.manifest import ModelManifest, digest
from exo_tp.weights.pieces import bad_blocks, iter_piece, write_piece
from exo_tp.weights.ranges import Ranges
from exo_tp.weights.transfer import Holding
from exo_tp.wire.ids import NodeId

JOURNAL = ".exo-tp-store.jsonl"
IDENTITY = ".exo-tp-store-identity"


class StoreRecord(Frozen):
    """One journal line: a verified piece written, an extra file written whole, or a piece
    found corrupt on disk (forgotten)."""

    kind: Literal["piece", "file", "lost"]
    name: str
    start: int = 0
    stop: int = 0


class NotHeld(ExoTpError):
    """A read of bytes the store does not hold."""


def store_root(identity: str) -> Path:
    """Where a node keeps the store of a model by default."""
    return cache_home() / "stores" / identity[:32]


class ShardStore:
    def __init__(self, root: Path, manifest: ModelManifest):
        self.root = Path(root)
        self.manifest = manifest
        self._lock = threading.Lock()
        self.root.mkdir(parents=True, exist_ok=True)
        marker = self.root / IDENTITY
        if marker.exists() and marker.read_text() != manifest.identity:
            raise ExoTpError(f"{self.root} holds another model ({marker.read_text()[:12]}...)")
        for wf in manifest.weight_files:
            path = self.root / wf.name
            if not path.exists() or path.stat().st_size != wf.size:
                header = wf.header.encode("utf-8")
                with open(path, "wb") as f:
                    f.write(struct.pack("<Q", len(header)) + header)
                    f.truncate(wf.size)  # the rest stays a hole until pieces arrive
        marker.write_text(manifest.identity)
        held: dict[str, Ranges] = {}
        files = set()
        journal = self.root / JOURNAL
        if journal.exists():
            for line in journal.read_text().splitlines():
                try:
                    record = StoreRecord.model_validate_json(line)
                except ValueError:
                    continue  # a line torn by a crash: its piece is simply fetched again
                piece = ((record.start, record.stop),)
                if record.kind == "file":
                    files.add(record.name)
                elif record.name in manifest.by_name:
                    before = held.get(record.name, ())
                    held[record.name] = (
                        R.union(before, piece)
                        if record.kind == "piece"
                        else R.subtract(before, piece)
                    )
        self._held = Boxes(ranges={k: v for k, v in held.items() if v})
        self._files = {f.name for f in manifest.extra_files if f.name in files}
        self._journal = open(journal, "a")  # noqa: SIM115 (open as long as the store)

    # ---- what it holds --------------------------------------------------------------------

    @property
    def folder(self) -> Path:
        """The model folder to load from (config, tokenizer, sparse weights)."""
        return self.root

    @property
    def held(self) -> Boxes:
        return self._held

    def has_file(self, name: str) -> bool:
        return name in self._files

    @property
    def extra_files_complete(self) -> bool:
        return all(f.name in self._files for f in self.manifest.extra_files)

    def missing(self, boxes: Boxes) -> Boxes:
        return boxes.minus(self._held)

    def require(self, boxes: Boxes) -> None:
        """Raise unless the store holds ``boxes`` and every extra file (ready to load)."""
        lacking = self.missing(boxes)
        if lacking.ranges or not self.extra_files_complete:
            raise ExoTpError(
                f"the shard store {self.root} lacks "
                f"{lacking.nbytes(self.manifest)} bytes of its shard"
                + ("" if self.extra_files_complete else " and model files")
            )

    def holding(self, node: NodeId) -> Holding:
        return Holding(node=node, store=self._held, extras=self.extra_files_complete)

    # ---- writing --------------------------------------------------------------------------

    def _record(self, record: StoreRecord) -> None:
        self._journal.write(record.model_dump_json() + "\n")
        self._journal.flush()

    def write_piece(self, tensor: str, start: int, stop: int, data: bytes) -> list[int]:
        """Verify the piece's blocks and write it in place; returns the blocks that did not
        match (then nothing is written)."""
        entry = self.manifest.tensor(tensor)
        bad = bad_blocks(entry, start, stop, data)
        if bad:
            return bad
        write_piece(self.root / entry.file, entry, start, stop, data)
        with self._lock:
            self._record(StoreRecord(kind="piece", name=tensor, start=start, stop=stop))
            ranges = dict(self._held.ranges)
            ranges[tensor] = R.union(ranges.get(tensor, ()), ((start, stop),))
            self._held = Boxes.model_construct(ranges=ranges)  # already normalized
        return []

    def write_file(self, name: str, data: bytes) -> bool:
        """Write an extra file whole if its digest matches; False if it does not."""
        wanted = next((f for f in self.manifest.extra_files if f.name == name), None)
        if wanted is None:
            raise ExoTpError(f"{name} is not a file of this model")
        if len(data) != wanted.size or hashlib.sha256(data).hexdigest() != wanted.digest:
            return False
        write_atomically(self.root / name, data)
        with self._lock:
            self._record(StoreRecord(kind="file", name=name))
            self._files.add(name)
        return True

    # ---- serving --------------------------------------------------------------------------

    def read_piece(
        self, tensor: str, start: int, stop: int, chunk: int = 1 << 20
    ) -> Iterator[bytes]:
        entry = self.manifest.tensor(tensor)
        if not self._held.covers(Boxes(ranges={tensor: ((start, stop),)})):
            raise NotHeld(f"{tensor}[{start}:{stop}] is not in this store")
        return iter_piece(self.root / entry.file, entry, start, stop, chunk)

    def read_file(self, name: str) -> bytes:
        if name not in self._files:
            raise NotHeld(f"{name} is not in this store")
        return (self.root / name).read_bytes()

    def verify(self) -> Boxes:
        """Re-hash every held block; forget (and return) the pieces that no longer match."""
        bad = []
        for name, a, b in self._held.pieces():
            entry = self.manifest.tensor(name)
            for block in entry.blocks(a, b):
                lo, hi = entry.cuts[block], entry.cuts[block + 1]
                data = b"".join(iter_piece(self.root / entry.file, entry, lo, hi))
                if digest(data) != entry.digests[block]:
                    bad.append((name, [(lo, hi)]))
        lost = Boxes.of(bad)
        with self._lock:
            for name, a, b in lost.pieces():
                self._record(StoreRecord(kind="lost", name=name, start=a, stop=b))
            self._held = self._held.minus(lost)
        return lost

    def close(self) -> None:
        self._journal.close()
