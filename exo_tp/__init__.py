"""exo-tp: tensor parallelism of any shape for mlx-lm models.

The library (docs/api.md, "Library"):

    exo_tp.load(model, ranks=3, weights=[5, 3, 2])  # local ranks; .generate / .stream_generate
    exo_tp.plan(model, weights=[5, 3, 2])            # the plan `exo-tp plan` prints
    exo_tp.Client("http://host:8000")                # a running cluster's state

Importing exo_tp does nothing else: the names above load their modules when first used, and no
BLAS, logging or environment is touched until something runs.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from exo_tp.library.client import Client
    from exo_tp.library.local import GenerationResponse, LoadedModel, load

__all__ = ["Client", "GenerationResponse", "LoadedModel", "load", "plan"]

_LAZY = {
    "load": "exo_tp.library.local",
    "LoadedModel": "exo_tp.library.local",
    "GenerationResponse": "exo_tp.library.local",
    "Client": "exo_tp.library.client",
}


def __getattr__(name: str) -> Any:
    import importlib

    if name == "plan":  # the planning package, callable as the library's plan()
        return importlib.import_module("exo_tp.plan")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'exo_tp' has no attribute {name!r}")


def _own_process_start() -> None:
    """In exo-tp's own processes (`exo-tp ...`, `python -m exo_tp...`), before anything imports
    mlx-lm: read transformers' table of lazy imports from disk instead of rebuilding it (~0.9 s
    of CPU each), and leave out the optional backends none of them uses (trio). A program that
    imports exo_tp as a library gets neither."""
    from exo_tp.process.lean_imports import keep_out, own_process

    if own_process(getattr(sys, "orig_argv", sys.argv)):
        from exo_tp.process.import_index import install

        install()
        keep_out()


_own_process_start()
