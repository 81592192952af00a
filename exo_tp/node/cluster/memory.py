"""Live memory readings a node reports in its status (psutil: the same on Linux and macOS)."""

from __future__ import annotations

import psutil


def memory_now(worker_pid: int | None) -> dict[str, int | None]:
    """This machine's memory now, and the resident memory of this node's worker (its share)."""
    machine = psutil.virtual_memory()
    worker = None
    if worker_pid is not None:
        try:
            worker = psutil.Process(worker_pid).memory_info().rss
        except psutil.Error:  # the worker just exited
            worker = None
    return {
        "total": machine.total,
        "available": machine.available,
        "used": machine.total - machine.available,
        "worker_rss": worker,
    }
