"""The lab's emulated slow device: a per-rank *work factor* s >= 1 (no MLX here).

A rank with factor s does s times the real work in every matmul (exo_tp.lab.slowdown), so it is
slow at every instant, as a slower machine is, unlike a CPU quota (which runs full speed, then
freezes the process for milliseconds while its peers spin in a collective). The factor reaches a
rank through its environment, so a rank started without it runs the unchanged code path:

- ``EXO_TP_WORK_FACTOR``: the factor (a number >= 1);
- ``EXO_TP_WORK_FACTOR_FILE``: a file holding the factor, re-read while serving (the lab changes
  a device's speed at run time with it; a missing or bad file counts as 1);
- ``EXO_TP_CPUS``: the cores the rank is pinned to (e.g. ``1`` or ``0,1``), so no two ranks
  time-share a core.

What it emulates: a device whose compute and weight reads are s times slower. What it does not:
the memory bus is still shared with the other ranks of this machine (a real second machine has
its own), and per-operation overheads (graph building, dispatch, collectives) are not scaled.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from exo_tp.atomic_file import write_atomically
from exo_tp.errors import ExoTpError
from exo_tp.frozen import replace
from exo_tp.plan.devices import DeviceProfile, MatmulScore
from exo_tp.process.blas import THREADS_ENV

log = logging.getLogger(__name__)

FACTOR_ENV = "EXO_TP_WORK_FACTOR"
FACTOR_FILE_ENV = "EXO_TP_WORK_FACTOR_FILE"
CPUS_ENV = "EXO_TP_CPUS"
MAX_FACTOR = 64.0  # beyond this the lab would only measure how long one waits
REREAD_SECONDS = 0.5


def check_factor(value: float, what: str = "work factor") -> float:
    if not math.isfinite(value) or value < 1 or value > MAX_FACTOR:
        raise ExoTpError(f"{what} {value:g} must be a number from 1 to {MAX_FACTOR:g}")
    return float(value)


def parse_factors(text: str, count: int | None = None, flag: str = "--work-factor") -> list[float]:
    """``1,2.5`` -> one factor per rank (each >= 1); ``count`` checks how many."""
    parts = [p.strip() for p in text.split(",")]
    try:
        factors = [float(p) for p in parts]
    except ValueError:
        raise ExoTpError(f"{flag} {text!r}: expected numbers like 1,2.5") from None
    for value in factors:
        check_factor(value, f"{flag}:")
    if count is not None and len(factors) != count:
        raise ExoTpError(f"{flag} has {len(factors)} values for {count} ranks")
    return factors


def split_factor(factor: float) -> tuple[int, float]:
    """(whole extra copies, fraction of one more copy) for a factor: 2.5 -> (1, 0.5)."""
    extra = factor - 1.0
    whole = math.floor(extra + 1e-9)
    return whole, max(0.0, extra - whole)


def read_factor_file(path: Path) -> float:
    """The factor in ``path``; 1 if it is missing or unreadable (logged once per bad text)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return 1.0
    try:
        return check_factor(float(text))
    except (ValueError, ExoTpError):
        log.warning("work factor file %s holds %r: using 1", path, text[:40])
        return 1.0


def write_factor_file(path: Path, factor: float) -> None:
    """Atomically (a reader never sees half a number)."""
    check_factor(factor)
    write_atomically(path, f"{factor:g}\n")


class FactorSource:
    """The rank's current factor: fixed, or re-read from a file by a thread every
    ``REREAD_SECONDS`` (readers only read a float: no lock needed)."""

    def __init__(self, factor: float = 1.0, path: Path | None = None):
        self.factor = check_factor(factor)
        self.path = path
        if path is not None:
            self.factor = read_factor_file(path)
            threading.Thread(target=self._watch, name="work-factor", daemon=True).start()

    def _watch(self) -> None:
        assert self.path is not None
        while True:
            time.sleep(REREAD_SECONDS)
            factor = read_factor_file(self.path)
            if factor != self.factor:
                log.info("work factor %g -> %g (from %s)", self.factor, factor, self.path)
                self.factor = factor


def source_from_env(env: Mapping[str, str] | None = None) -> FactorSource | None:
    """The factor the environment sets; None when the lab option is off (nothing is wrapped)."""
    env = os.environ if env is None else env
    path, value = env.get(FACTOR_FILE_ENV), env.get(FACTOR_ENV)
    if not path and not value:
        return None
    factor = check_factor(float(value)) if value else 1.0
    return FactorSource(factor, Path(path) if path else None)


def lab_environment(
    factor: float | None, factor_file: str | None, cpus: Sequence[int] | None
) -> dict[str, str]:
    """The variables that give a rank its factor and cores (empty when the lab is off)."""
    env: dict[str, str] = {}
    if factor is not None:
        env[FACTOR_ENV] = f"{check_factor(factor):g}"
    if factor_file:
        env[FACTOR_FILE_ENV] = str(Path(factor_file).resolve())
    if cpus:
        env[CPUS_ENV] = ",".join(str(c) for c in cpus)
        # A rank pinned to k cores runs k BLAS threads (ignored by MLX's bundled BLAS).
        env[THREADS_ENV] = str(len(cpus))
    return env


def core_for(index: int) -> list[int]:
    """The core the index-th rank (or local node) of the lab runs on: one each, in turn, over
    the cores this process may use."""
    cores = sorted(os.sched_getaffinity(0))
    return [cores[index % len(cores)]]


def pin_from_env(env: Mapping[str, str] | None = None) -> list[int] | None:
    """Pin this process to the cores ``EXO_TP_CPUS`` names (threads started later inherit
    them); None when unset."""
    env = os.environ if env is None else env
    text = env.get(CPUS_ENV)
    if not text:
        return None
    try:
        cores = [int(c) for c in text.split(",") if c.strip()]
        # The call pins one thread: pin every thread already started (MLX's, imports'), and
        # threads started later inherit it.
        for task in Path("/proc/self/task").iterdir():
            os.sched_setaffinity(int(task.name), cores)
        os.sched_setaffinity(0, cores)
    except (ValueError, OSError) as error:
        log.warning("cannot pin to cores %r: %s", text, error)
        return None
    return cores


def scaled_profile(profile: DeviceProfile, factor: float) -> DeviceProfile:
    """The profile a device ``factor`` times slower would measure: what `exo-tp run
    --local-nodes` gives each node when the machine was measured once at factor 1 (the bench
    measured under the factor scores the same, see `exo-tp bench --work-factor`)."""
    check_factor(factor)
    if factor == 1:
        return profile

    def slower(scores: tuple[MatmulScore, ...]) -> tuple[MatmulScore, ...]:
        return tuple(
            replace(
                k,
                seconds=k.seconds * factor,
                flops=k.flops / factor,
                weight_bytes_per_second=k.weight_bytes_per_second / factor,
            )
            for k in scores
        )

    return replace(
        profile,
        decode_seconds_per_byte=profile.decode_seconds_per_byte * factor,
        prefill_flops=profile.prefill_flops / factor,
        kernels=slower(profile.kernels),
        shapes=slower(profile.shapes),
    )
