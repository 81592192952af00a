"""Where exo-tp keeps its cache (prepared models, device profiles) and its settings."""

import os
from pathlib import Path


def cache_home() -> Path:
    """`$EXO_TP_HOME`, else `$XDG_CACHE_HOME/exo-tp`, else `~/.cache/exo-tp`."""
    if home := os.environ.get("EXO_TP_HOME"):
        return Path(home)
    return user_cache_home()


def user_cache_home() -> Path:
    """`$XDG_CACHE_HOME/exo-tp`, else `~/.cache/exo-tp`, whatever `$EXO_TP_HOME` says: for
    what describes this machine's Python install rather than a node (the import table), which
    every home on the machine shares."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "exo-tp"


def config_home() -> Path:
    """`$XDG_CONFIG_HOME/exo-tp`, else `~/.config/exo-tp` (settings that are not a cache: the
    cluster secret)."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "exo-tp"
