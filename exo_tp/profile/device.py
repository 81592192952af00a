"""Measure this device: memory bandwidth, every kernel, and the two scores the planner reads.

The scores are defined in `exo_tp.plan.devices` (decode: mean seconds per weight byte of
decode-shaped float32 matvecs streaming from memory; prefill: FLOP/s of 128-token float32
matmuls). ``--quick`` measures the same kernels for less time each, except the prefill products
of dtypes other than the engine's, which only the full run reports (no score reads them), so
both modes give the same scores; the default only averages longer. Every kernel is timed by its
mean over its whole measured stretch (see `timing`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from exo_tp.plan.devices import DeviceProfile, MatmulScore, decode_seconds_per_byte, prefill_flops
from exo_tp.profile.kernels import KernelCase, WeightSource, kernel_cases, measure_kernel
from exo_tp.profile.memory import read_bandwidth
from exo_tp.profile.overhead import layer_overhead_seconds
from exo_tp.profile.progress import Progress
from exo_tp.profile.system import system_info
from exo_tp.wire.profiles import ENGINE_DTYPE, measured_now

# Minimum wall time per kernel: long enough to span many CFS periods of a CPU quota. The
# kernels behind the headline scores (the engine's dtype) get HEADLINE_FACTOR times longer, so a
# burst of noise from other processes moves them less.
MIN_SECONDS = {True: 0.1, False: 0.6}
HEADLINE_FACTOR = 3


def measure_shapes(
    dtype: str,
    shapes: Sequence[tuple[int, int]],
    quick: bool,
    progress: Progress,
    work_factor: float = 1.0,
) -> tuple[MatmulScore, ...]:
    """Decode matvecs of ``shapes`` (k, n) in ``dtype`` (a model's, `exo_tp.profile.shapes`)."""
    if not shapes:
        return ()
    progress.expect(len(shapes) + 1)
    with progress.step("random weights for the model's shapes"):
        source = WeightSource(tuple(shapes))
    measured = []
    for k, n in shapes:
        case = KernelCase("matvec", dtype, 1, k, n)
        with progress.step(case.label):
            measured.append(measure_kernel(case, source, MIN_SECONDS[quick], work_factor))
    return tuple(measured)


def measure_device(
    quick: bool, progress: Progress | None = None, work_factor: float = 1.0
) -> DeviceProfile:
    """``work_factor``: measure as the lab's emulated device that much slower (exo_tp.lab)."""
    progress = progress or Progress(enabled=False)
    start = time.perf_counter()
    seconds = MIN_SECONDS[quick]
    cases = kernel_cases(quick)
    progress.expect(len(cases) + 3)
    info = system_info()
    with progress.step("random weights"):
        source = WeightSource()
    with progress.step("memory read bandwidth"):
        bandwidth = read_bandwidth(source.words, seconds)
    kernels = []
    for case in cases:
        with progress.step(case.label):
            factor = HEADLINE_FACTOR if case.dtype == ENGINE_DTYPE else 1
            kernels.append(measure_kernel(case, source, seconds * factor, work_factor))
    with progress.step("per-layer overhead"):
        overhead = layer_overhead_seconds(seconds)
    decode = decode_seconds_per_byte(kernels, ENGINE_DTYPE)
    prefill = prefill_flops(kernels, ENGINE_DTYPE)
    assert decode is not None and prefill is not None, "the engine's dtype is always measured"
    return DeviceProfile(
        **info.model_dump(),
        memory_bandwidth=bandwidth,
        decode_seconds_per_byte=decode,
        prefill_flops=prefill,
        decode_dtype=ENGINE_DTYPE,
        layer_overhead_seconds=overhead,
        kernels=tuple(kernels),
        quick=quick,
        measured_at=measured_now(),
        duration_seconds=round(time.perf_counter() - start, 2),
    )
