"""Bytes of a checkpoint's tensors as stored, from the safetensors headers alone (no MLX)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def stored_bytes(model_dir: Path, keep: Callable[[str], bool]) -> int:
    """Bytes of the tensors of ``model_dir`` whose names ``keep`` accepts."""
    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with path.open("rb") as file:
            size = int.from_bytes(file.read(8), "little")
            header = json.loads(file.read(size))
        for name, info in header.items():
            if name != "__metadata__" and keep(name):
                start, stop = info["data_offsets"]
                total += stop - start
    return total
