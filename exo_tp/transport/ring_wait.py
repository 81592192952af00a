"""Ranks that wait in a ring collective sleep on the socket instead of spinning a core.

MLX's ring backend gives each socket a thread that calls ``recv``/``send`` on a non-blocking
socket in a loop until its transfer is done (``SocketThread::worker`` in MLX's ring.cpp): a rank
waiting for a slower peer spins a whole core on ``EAGAIN``. Where ranks share cores (more ranks
than cores under ``exo-tp launch`` or ``--local-nodes``, or a rank beside its node's API server
and tokenizer), the spinning rank takes the core from the very process it waits for, and every
collective costs a scheduler tick. Measured on a 2-core machine, 3 ranks decode 4.6x faster
when their waits sleep (docs/benchmarks.md, "Ring waits").

A tiny preloaded library wraps ``recv`` and ``send``: when the call would block, it waits in
``poll`` for the socket to be ready, at most 1 ms (the kernel wakes it as soon as data arrives),
then returns ``EAGAIN`` as before, so MLX's loop and its results are unchanged. Its 1 ms bound
keeps a thread that also has a send queued from holding that send for long.

It is built once per machine with the C compiler into the cache (``native/``), and preloaded
into rank processes only (`exo_tp.transport.ring.ring_env`). ``EXO_TP_RING_WAIT`` chooses:
``auto`` (the default) sleeps where a host's ranks outnumber its cores and spins where each
has a core, which is faster there (a sleeping wait's wake-up cost 16% of decode speed at 2
ranks on 2 cores); ``sleep``; or ``spin`` (MLX as it is). Without a compiler, or off Linux,
ranks spin as before, and the reason is logged once.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from exo_tp.errors import ExoTpError
from exo_tp.paths import cache_home

log = logging.getLogger(__name__)

WAIT_ENV = "EXO_TP_RING_WAIT"
PRELOAD_ENV = "LD_PRELOAD"

SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>

typedef ssize_t (*io_fn)(int, void *, size_t, int);

/* Wait (at most 1 ms) until fd is ready for `events`, keeping the caller's errno. */
static void wait_ready(int fd, short events) {
  int saved = errno;
  struct pollfd ready = {fd, events, 0};
  poll(&ready, 1, 1);
  errno = saved;
}

ssize_t recv(int fd, void *buf, size_t len, int flags) {
  static io_fn real;
  if (!real) real = (io_fn)dlsym(RTLD_NEXT, "recv");
  ssize_t got = real(fd, buf, len, flags);
  if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) wait_ready(fd, POLLIN);
  return got;
}

ssize_t send(int fd, const void *buf, size_t len, int flags) {
  static io_fn real;
  if (!real) real = (io_fn)dlsym(RTLD_NEXT, "send");
  ssize_t sent = real(fd, (void *)buf, len, flags);
  if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) wait_ready(fd, POLLOUT);
  return sent;
}
"""


def sleeping_waits(base: Mapping[str, str] | None = None, ranks_here: int = 1) -> dict[str, str]:
    """The variables that make a rank started with ``base`` (default: this process's
    environment) sleep in its ring waits: ``LD_PRELOAD`` with the wait library first, then
    whatever ``base`` preloads (OpenBLAS). Empty when its waits are to spin: by default
    (``auto``) while the ``ranks_here`` ranks of its host have a core each, where MLX's spin
    is the faster (a sleeping wait's wake-up cost 16% of decode speed at 2 ranks on 2 cores)."""
    env = os.environ if base is None else base
    choice = env.get(WAIT_ENV, "auto").strip() or "auto"
    if choice not in ("auto", "sleep", "spin"):
        raise ExoTpError(f"{WAIT_ENV}={choice!r}: use auto, sleep or spin")
    if choice == "auto" and ranks_here <= _cores():
        return {}
    if choice == "spin" or not sys.platform.startswith("linux"):
        return {}
    library = wait_library()
    if library is None:
        return {}
    preloaded = env.get(PRELOAD_ENV, "").split()
    if library in preloaded:
        return {}
    return {PRELOAD_ENV: " ".join([library, *preloaded])}


@functools.lru_cache(maxsize=1)
def wait_library() -> str | None:
    """The wait library's path, built on first use (once per machine and source); None, logged
    once, when it cannot be built here."""
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:12]
    target = cache_home() / "native" / f"ring-wait-{digest}.so"
    if target.exists():
        return str(target)
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("ring waits spin: no C compiler (cc) to build %s", target.name)
        return None
    try:
        _build(compiler, target)
    except (OSError, subprocess.SubprocessError) as error:
        log.warning("ring waits spin: building %s with %s failed: %s", target.name, compiler, error)
        return None
    return str(target)


def _build(compiler: str, target: Path) -> None:
    """Compile into a file of its own, then rename: ranks that start together may all build."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        source, built = Path(scratch) / "ring_wait.c", Path(scratch) / target.name
        source.write_text(SOURCE)
        command = [compiler, "-O2", "-shared", "-fPIC", "-o", str(built), str(source), "-ldl"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise subprocess.SubprocessError(done.stderr.strip().splitlines()[-1:] or done)
        os.replace(built, target)


def _cores() -> int:
    """The cores this process may run on (as `exo_tp.process.blas.usable_cores`, which this
    package may not import: process imports transport)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
