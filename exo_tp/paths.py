"""Where exo-tp keeps its cache (prepared models, device profiles)."""

import os
from pathlib import Path


def cache_home() -> Path:
    """`$EXO_TP_HOME`, else `$XDG_CACHE_HOME/exo-tp`, else `~/.cache/exo-tp`."""
    if home := os.environ.get("EXO_TP_HOME"):
        return Path(home)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "exo-tp"
