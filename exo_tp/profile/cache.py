"""The device profile cached in the user's cache folder, reused until ``--refresh``.

A cached profile is reused only if it was measured on the same chip, core count, MLX version,
device and BLAS, and is not a ``--quick`` one when a full measurement is asked for. Memory
figures are always read afresh. An unreadable or invalid cache is reported on stderr and
measured again, never a crash.
"""

from __future__ import annotations

import logging
from pathlib import Path

from exo_tp.atomic_file import write_atomically
from exo_tp.errors import ExoTpError
from exo_tp.frozen import replace
from exo_tp.paths import cache_home
from exo_tp.plan.devices import DeviceProfile, read_profile
from exo_tp.process.blas import openblas_threads, usable_cores
from exo_tp.profile.device import measure_device, measure_shapes
from exo_tp.profile.progress import Progress
from exo_tp.profile.shapes import NO_SHAPES, ModelShapes
from exo_tp.profile.system import SystemInfo, system_info

log = logging.getLogger(__name__)


def profile_path(work_factor: float = 1.0) -> Path:
    """The cache file; a lab work factor (exo_tp.lab) has its own, never the real device's.

    So does each OpenBLAS thread count other than one per usable core (what `exo-tp bench`
    runs): `run --local-nodes N` measures with the threads each of its ranks gets, and one
    shared file would make each of the two commands find the other's profile stale and measure
    again, every time."""
    name = "profile" if work_factor == 1 else f"profile-work-factor-{work_factor:g}"
    threads = openblas_threads()
    if threads is not None and threads != usable_cores():
        name += f"-{threads}-blas-threads"
    return cache_home() / f"{name}.json"


def load_cached(path: Path, if_invalid: str = "measuring again") -> DeviceProfile | None:
    """The profile cached at ``path``; None if there is none, or (with a warning ending in
    ``if_invalid``) if it cannot be read."""
    if not path.exists():
        return None
    try:
        return read_profile(path)
    except ExoTpError as error:
        log.warning("%s; %s", error, if_invalid)
        return None


def _stale(cached: DeviceProfile, now: SystemInfo, quick: bool) -> str | None:
    """Why ``cached`` cannot stand for this device now (None: it can)."""
    for field in ("chip", "cores", "mlx_version", "mlx_device", "blas"):
        if getattr(cached, field) != getattr(now, field):
            return f"{field} changed ({getattr(cached, field)} -> {getattr(now, field)})"
    if cached.quick and not quick:
        return "it is a --quick profile"
    if cached.layer_overhead_seconds <= 0:
        return "it was measured before the per-layer overhead was"
    return None


def save(profile: DeviceProfile, path: Path) -> None:
    """Write atomically (a crash never leaves half a file); links and node id are per run."""
    write_atomically(path, replace(profile, links=(), node_id="").model_dump_json(indent=2))


def cached_profile(
    quick: bool = True, path: Path | None = None, if_invalid: str = "measuring again"
) -> DeviceProfile | None:
    """The cached profile if it stands for this device now (with live memory figures), else
    None (a reason is logged)."""
    path = path or profile_path()
    cached = load_cached(path, if_invalid)
    if cached is None:
        return None
    now = system_info()
    reason = _stale(cached, now, quick)
    if reason is not None:
        log.info("cached profile %s not reused: %s", path, reason)
        return None
    return replace(
        cached,
        hostname=now.hostname,
        memory_total=now.memory_total,
        memory_available=now.memory_available,
    )


def missing_shapes(profile: DeviceProfile, shapes: ModelShapes) -> list[tuple[int, int]]:
    """The (k, n) of ``shapes`` that ``profile`` has not measured yet."""
    have = {(k.dtype, k.k, k.n) for k in profile.shapes}
    return [s for s in shapes.shapes if (shapes.dtype, *s) not in have]


def device_profile(
    refresh: bool = False,
    quick: bool = False,
    progress: Progress | None = None,
    path: Path | None = None,
    work_factor: float = 1.0,
    shapes: ModelShapes = NO_SHAPES,
) -> tuple[DeviceProfile, bool]:
    """This device's profile and whether it came from the cache (``work_factor``: as the lab's
    emulated device that much slower), with the matvecs of a model's ``shapes`` the cached one
    lacks measured now and cached with it."""
    path = path or profile_path(work_factor)
    progress = progress or Progress(enabled=False)
    profile = None if refresh else cached_profile(quick, path)
    cached = profile is not None
    if profile is None:
        profile = measure_device(quick, progress, work_factor)
    missing = missing_shapes(profile, shapes)
    if cached and not missing:
        return profile, True
    if missing:
        more = measure_shapes(shapes.dtype, missing, quick, progress, work_factor)
        profile = replace(profile, shapes=profile.shapes + more)
    try:
        save(profile, path)
    except OSError as error:
        log.warning("cannot cache the profile in %s: %s", path, error.strerror or error)
    return profile, cached
