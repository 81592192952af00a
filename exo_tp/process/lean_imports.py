"""Optional imports kept out of exo-tp's own processes.

httpcore2 (under huggingface_hub, whose API module mlx-lm's ``utils`` import in every rank and
node) imports trio whenever it is installed, only to support trio's event loop, which no
exo-tp process runs. Where trio is installed (selenium brings it) that is ~0.14 s of CPU per
process, and a 3-node cluster starts seven. In a process started as one of exo-tp's own
commands (`exo-tp ...`, `python -m exo_tp...`) the import is answered "not installed", the
case httpcore2 handles; a program that imports exo_tp as a library keeps its trio.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

UNUSED_OPTIONAL = ("trio",)  # optional backends no exo-tp process uses


def own_process(argv: Sequence[str]) -> bool:
    """Whether ``argv`` (the interpreter's original command line) runs an exo-tp command:
    ``python [options] -m exo_tp...`` or ``python [options] .../exo-tp ...``."""
    i = 1
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-":
        if argv[i] == "-m":
            return i + 1 < len(argv) and argv[i + 1].split(".")[0] == "exo_tp"
        if argv[i] == "-c":
            return False
        i += 2 if argv[i] in ("-X", "-W") else 1  # the options that take a value apart
    return i < len(argv) and Path(argv[i]).name == "exo-tp"


def keep_out() -> None:
    """In an exo-tp command's process, mark the unused optional modules as not installed
    (unless something imported one already)."""
    if own_process(getattr(sys, "orig_argv", sys.argv)):
        for name in UNUSED_OPTIONAL:
            sys.modules.setdefault(name, None)  # type: ignore[arg-type]


if __name__ == "__main__":  # `python -m exo_tp.process.lean_imports`: an exo-tp process's view
    # of each module left out (what its tests check): "trio: left out" or "trio: imported"
    import importlib

    for name in UNUSED_OPTIONAL:
        try:
            importlib.import_module(name)
            print(f"{name}: imported")
        except ImportError:
            print(f"{name}: left out")
