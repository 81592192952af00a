"""What a node keeps on disk of its weights: the folders it was given (``OwnFolder``), and
its shard stores, each with a ``StoreInfo`` beside it and a lock while a process uses it."""

from __future__ import annotations

import asyncio
import fcntl
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from exo_tp.frozen import Frozen
from exo_tp.weights.build import WEIGHT_SUFFIX, read_header
from exo_tp.weights.manifest import ModelManifest
from exo_tp.wire.ids import ModelKey

STORE_INFO = ".exo-tp-store-info.json"
STORE_LOCK = ".exo-tp-store.lock"


class StoreInfo(Frozen):
    """Kept beside a store: what it mirrors, to offer and serve it again after a restart."""

    name: str
    manifest: ModelManifest


@dataclass
class OwnFolder:
    name: str
    folder: Path
    key: ModelKey
    weight_bytes: int
    manifest: ModelManifest | None = None
    draft: bool = False  # offered only as a draft model (ModelOffer.draft)
    computing: asyncio.Future[ModelManifest] | None = None


def weight_bytes(folder: Path) -> int:
    """Bytes of tensor data in the folder's safetensors files (headers excluded)."""
    total = 0
    for path in folder.glob(f"*{WEIGHT_SUFFIX}"):
        header, _ = read_header(path)
        total += path.stat().st_size - 8 - len(header.encode())
    return total


def claim(root: Path) -> IO[str] | None:
    """An exclusive lock on a store folder while this process lives (None: another process
    on this machine uses it)."""
    root.mkdir(parents=True, exist_ok=True)
    handle = open(root / STORE_LOCK, "a")  # noqa: SIM115 (held as long as the store)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle
