"""What this device is: chip, cores, memory, MLX version and device, distributed backends, and
the BLAS a CPU build multiplies with."""

from __future__ import annotations

import platform
import socket

import mlx.core as mx
import psutil

from exo_tp.plan.spec import Frozen
from exo_tp.process.blas import active_blas, usable_cores
from exo_tp.shard.row_pieces import pieces_wanted

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
    blas: str  # where float32 matmuls go on a CPU build (exo_tp.process.blas)


def _chip() -> str:
    try:
        name = str(mx.device_info().get("device_name", ""))
    except (AttributeError, RuntimeError):  # older MLX, or no device info for this device
        name = ""
    return name or platform.processor() or platform.machine() or "unknown"


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
        cores=usable_cores(),
        mlx_version=mx.__version__,  # type: ignore[attr-defined]  # (not in mlx's stubs)
        mlx_device=mx.default_device().type.name,
        memory_total=total,
        memory_available=available,
        backends=_backends(),
        blas=_blas() if mx.default_device().type == mx.DeviceType.cpu else "",
    )


def _blas() -> str:
    # A profile measured with whole one-row products prices them at the slower speed: its
    # cache must not stand for a process that multiplies in row pieces, nor the reverse.
    return active_blas() + (", one-row products in row pieces" if pieces_wanted() else "")
