"""A disk copy of transformers' table of lazy imports, so that a process starts without
rebuilding it.

transformers 5 builds, on every import, the table its lazy modules resolve names from, by
reading every file under ``transformers/models`` and parsing its ``__all__`` (about 1,100
files): over a second of CPU, the largest part of importing mlx-lm (whose ``utils`` and
``generate`` import transformers). Every rank, node and CLI process exo-tp starts imports
mlx-lm, so a 3-rank launch paid it four times and a 3-node cluster seven. The table depends
only on the installed files, so it is built once per installed transformers and kept under
``user_cache_home()/imports`` (the user's cache, not ``$EXO_TP_HOME``: every home on the
machine shares one Python install, and tests and benches that give each node a home of its own
would otherwise build it in each); a later process reads it back instead (docs/architecture.md,
"Processes"). Anything unexpected (another transformers without this function, an unreadable
or foreign file) falls back to transformers' own build: the copy can only save time.
``EXO_TP_IMPORT_INDEX=off`` turns it off.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Any

from exo_tp.atomic_file import write_atomically
from exo_tp.paths import user_cache_home

SWITCH_ENV = "EXO_TP_IMPORT_INDEX"
TARGET = "transformers.utils.import_utils"  # where transformers builds the table
FUNCTION = "define_import_structure"

Table = dict[frozenset[str], dict[str, set[str]]]


def _stamp(path: Path) -> str:
    stat = path.stat()
    return f"{path}:{stat.st_mtime_ns}:{stat.st_size}"


def _cache_file(builder_file: Path, module_path: Any, prefix: str | None) -> Path:
    """One file per (installed transformers, folder, prefix): a reinstall rewrites the
    builder's file, and a changed folder changes its mtime, so neither reads a stale table."""
    key = "|".join((_stamp(builder_file), _stamp(Path(module_path)), str(prefix)))
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return user_cache_home() / "imports" / f"transformers-{digest}.json"


def _encode(table: Table) -> str:
    return json.dumps(
        [
            [sorted(backends), {m: sorted(n) for m, n in mods.items()}]
            for backends, mods in table.items()
        ]
    )


def _decode(text: str) -> Table:
    table: Table = {}
    for backends, mods in json.loads(text):
        lists = isinstance(mods, dict) and all(isinstance(n, list) for n in mods.values())
        if not (isinstance(backends, list) and lists):
            raise ValueError("not an import table")
        table[frozenset(map(str, backends))] = {str(m): set(map(str, n)) for m, n in mods.items()}
    return table


def _write(path: Path, text: str) -> None:
    """Atomically: processes starting side by side may write the same table at once."""
    write_atomically(path, text)


def _with_copy(build: Callable[..., Table], builder_file: Path) -> Callable[..., Table]:
    # lru_cache as transformers' own: the same object for the same call within a process
    # (transformers/__init__ adds entries to the table it gets back).
    @functools.lru_cache
    def define_import_structure(module_path: Any, prefix: str | None = None) -> Table:
        try:
            path = _cache_file(builder_file, module_path, prefix)
        except OSError:
            return build(module_path, prefix)
        with contextlib.suppress(OSError, ValueError, TypeError):
            return _decode(path.read_text())
        table = build(module_path, prefix)
        with contextlib.suppress(OSError, TypeError, ValueError):
            _write(path, _encode(table))
        return table

    return define_import_structure


class _Finder(importlib.abc.MetaPathFinder):
    """Finds transformers' builder module as the path finder does, and replaces its table
    function as soon as the module has run (before transformers' ``__init__`` calls it)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)  # one module, once
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader = spec.loader if spec is not None else None
        if (
            spec is None
            or spec.origin is None
            or loader is None
            or not hasattr(loader, "exec_module")
        ):
            return spec
        run = loader.exec_module
        origin = Path(spec.origin)

        def exec_module(module: ModuleType) -> None:
            run(module)
            build = getattr(module, FUNCTION, None)
            if callable(build):
                setattr(module, FUNCTION, _with_copy(build, origin))

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Before transformers is imported (exo_tp's ``__init__``); nothing if it already is,
    or if ``EXO_TP_IMPORT_INDEX=off``."""
    if os.environ.get(SWITCH_ENV, "").lower() in ("off", "0", "false"):
        return
    if TARGET in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
