"""What this device is: chip, cores, memory, MLX version and device, distributed backends."""

from __future__ import annotations

import os
import platform
import socket

import mlx.core as mx
import psutil

from exo_tp.plan.spec import Frozen

BACKENDS = ("ring", "jaccl", "mpi", "nccl")


class SystemInfo(Frozen):
    hostname: str
    chip: str
    cores: int
    mlx_version: str
    mlx_device: str
    memory_total: int
    memory_available: int
    backends: tuple[str, ...]


def _chip() -> str:
    try:
        name = str(mx.device_info().get("device_name", ""))
    except (AttributeError, RuntimeError):  # older MLX, or no device info for this device
        name = ""
    return name or platform.processor() or platform.machine() or "unknown"


def _cores() -> int:
    # The cores this process may run on (taskset/cgroups), not every core of the machine.
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _backends() -> tuple[str, ...]:
    """Backends this MLX build can instantiate (availability, not a working group)."""
    available = []
    for name in BACKENDS:
        try:
            if mx.distributed.is_available(name):
                available.append(name)
        except (TypeError, ValueError, RuntimeError):  # an MLX without this backend name
            continue
    return tuple(available)


def memory() -> tuple[int, int]:
    """(total, available) bytes of RAM right now."""
    vm = psutil.virtual_memory()
    return int(vm.total), int(vm.available)


def system_info() -> SystemInfo:
    total, available = memory()
    return SystemInfo(
        hostname=socket.gethostname(),
        chip=_chip(),
        cores=_cores(),
        mlx_version=mx.__version__,
        mlx_device=mx.default_device().type.name,
        memory_total=total,
        memory_available=available,
        backends=_backends(),
    )
