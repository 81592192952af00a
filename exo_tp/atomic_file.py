"""Files written whole or not at all.

Readers (another process starting side by side, a peer, the next run after a crash) must never
see half a file: the data goes to a temporary file in the same folder, which then replaces the
target in one rename. A failed write (a full disk) leaves neither half a file nor the
temporary one behind.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_atomically(path: Path, data: str | bytes) -> None:
    """``path`` holds ``data`` (text as UTF-8), its folder made if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data.encode() if isinstance(data, str) else data)
        os.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
