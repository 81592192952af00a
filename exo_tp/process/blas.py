"""Which BLAS MLX's CPU build multiplies float32 matrices with on Linux.

The `mlx[cpu]` wheel ships the reference BLAS: about 7 GFLOP/s a core on this machine whatever
the shape, so a prompt of 16 tokens costs 16 decode steps and a batch of 16 streams 16 times
one. MLX resolves `cblas_sgemm` when it loads, from whatever library the dynamic loader offers
first, so preloading the system's OpenBLAS (`libopenblas0-pthread` on Debian) swaps in an
optimised kernel with no change to MLX: 110-120 GFLOP/s a core on batched matmuls here,
prefill 9.6-13.7x and decode 1.2-1.5x faster (docs/benchmarks.md, "BLAS"). macOS builds use
Accelerate and are left alone.

`EXO_TP_BLAS` chooses: ``auto`` (the default: OpenBLAS when the system has it), ``bundled``
(MLX's own), or the path of a CBLAS library. The choice travels in the environment: `exo-tp`
re-executes itself once with the library preloaded (`preload_blas`), and every process it
starts inherits it. Processes that share this machine's cores split OpenBLAS's threads
(`share_cores`, `group_threads`), so local ranks do not oversubscribe the cores.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from exo_tp.errors import ExoTpError

BLAS_ENV = "EXO_TP_BLAS"
PRELOAD_ENV = "LD_PRELOAD"
THREADS_ENV = "OPENBLAS_NUM_THREADS"
# Set by `preload_blas` in the process it re-executes: what it preloaded, so that neither it
# nor a child re-executes again, and `share_cores` knows OpenBLAS is in use.
PRELOADED_ENV = "EXO_TP_BLAS_PRELOADED"
BUNDLED_BLAS = "MLX's bundled BLAS"  # what `active_blas` says without a preloaded library


def blas_library(setting: str | None) -> str | None:
    """The CBLAS library to preload for ``setting`` (``EXO_TP_BLAS``); None for MLX's own.

    Raises ExoTpError for a path that is not a loadable CBLAS library (the user asked for it).
    """
    choice = (setting or "auto").strip()
    if choice == "bundled" or not sys.platform.startswith("linux"):
        return None
    if choice == "auto":
        found = ctypes.util.find_library("openblas")
        return found if found and _has_sgemm(found) else None
    if not _has_sgemm(choice):
        raise ExoTpError(
            f"{BLAS_ENV}={choice!r}: not a loadable CBLAS library with cblas_sgemm "
            "(use auto, bundled, or the path of e.g. libopenblas.so.0)"
        )
    return str(Path(choice).resolve()) if os.sep in choice else choice


def _has_sgemm(library: str) -> bool:
    try:
        return hasattr(ctypes.CDLL(library), "cblas_sgemm")
    except OSError:
        return False


def preload_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) with the chosen BLAS preloaded: what a program
    started with it multiplies with (the benches start mlx-lm and exo-tp alike so). Unchanged
    when nothing is to be preloaded (macOS, ``bundled``, no OpenBLAS) or it already is."""
    env = dict(os.environ if environ is None else environ)
    if PRELOADED_ENV in env:
        return env
    library = blas_library(env.get(BLAS_ENV))
    if library is None:
        return env
    env[PRELOADED_ENV] = library
    env[PRELOAD_ENV] = " ".join(p for p in (library, env.get(PRELOAD_ENV, "")) if p)
    return env


def preload_blas() -> None:
    """Re-execute this process with the chosen BLAS preloaded, once; returns when nothing is to
    be preloaded or it already is. Call it before MLX loads: the loader reads ``LD_PRELOAD``
    only when a program starts."""
    env = preload_environment()
    if env.get(PRELOAD_ENV) != os.environ.get(PRELOAD_ENV):
        # sys.orig_argv keeps how Python was started (`-m exo_tp`, or the console script).
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def active_blas() -> str:
    """The library this process's ``cblas_sgemm`` comes from (where MLX's CPU build finds it
    too: a preloaded library is searched first) and its thread count, in words; device
    profiles record it, since their speeds hold for it only."""
    if not sys.platform.startswith("linux"):
        return "MLX's own"
    library = _sgemm_library()
    if library is None:
        return BUNDLED_BLAS
    count = openblas_threads()
    threads = f"{count} thread{'s' if count != 1 else ''}" if count else "its own threads"
    return f"{library} ({threads})"


def openblas_threads() -> int | None:
    """OpenBLAS's thread count in this process right now; None without OpenBLAS."""
    get = _openblas("openblas_get_num_threads")
    return int(get()) if get is not None else None


@contextlib.contextmanager
def blas_threads(threads: int) -> Iterator[None]:
    """OpenBLAS runs ``threads`` threads inside the block (nothing without OpenBLAS): a
    measurement for processes that will share this machine's cores."""
    get, put = _openblas("openblas_get_num_threads"), _openblas("openblas_set_num_threads")
    if get is None or put is None:
        yield
        return
    before = get()
    put(max(1, threads))
    try:
        yield
    finally:
        put(before)


def _openblas(name: str) -> Any:
    try:
        return getattr(ctypes.CDLL(None), name)
    except (AttributeError, OSError):
        return None


def _sgemm_library() -> str | None:
    """The file that the process-wide ``cblas_sgemm`` lives in; None when none is loaded yet
    (MLX's bundled one loads with MLX)."""
    try:
        address = ctypes.cast(ctypes.CDLL(None).cblas_sgemm, ctypes.c_void_p).value or 0
        maps = Path("/proc/self/maps").read_text()
    except (AttributeError, OSError):
        return None
    for line in maps.splitlines():
        fields = line.split()
        start, _, stop = fields[0].partition("-")
        if len(fields) >= 6 and int(start, 16) <= address < int(stop, 16):
            return fields[5]
    return None


def share_cores(processes: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Variables for one of ``processes`` processes that share this machine's cores: an equal
    part of them for OpenBLAS's threads. Empty when OpenBLAS is not preloaded or the thread
    count is set already (by the user, or by the process that started this one)."""
    env = os.environ if environ is None else environ
    if PRELOADED_ENV not in env or THREADS_ENV in env:
        return {}
    return {THREADS_ENV: str(max(1, usable_cores() // max(1, processes)))}


def usable_cores() -> int:
    """The cores this process may run on (taskset, cgroups), not every core of the machine."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def group_threads(
    addresses: Sequence[str], rank: int, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """`share_cores` for ``rank`` of a group whose ranks listen at ``addresses`` ("ip:port"):
    the ranks on its host share its cores (all of `exo-tp launch`'s; one per machine in a
    cluster of machines)."""
    if not addresses:
        return share_cores(1, environ)
    host = addresses[rank].rsplit(":", 1)[0]
    return share_cores(sum(a.rsplit(":", 1)[0] == host for a in addresses), environ)
