"""The lab's emulated slow device (exo_tp.lab): the work factor on real data, its flags, its
profile, and its speed (issue #19)."""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from helpers import CLI, launch, run_cli

from exo_tp.errors import ExoTpError
from exo_tp.lab.factor import (
    FactorSource,
    check_factor,
    parse_factors,
    scaled_profile,
    split_factor,
)
from exo_tp.lab.slowdown import SlowLinear, slow_down
from exo_tp.plan.devices import DeviceProfile, MatmulScore
from exo_tp.profile.system import system_info

MODEL = "smollm2-135m"
PROMPT = "What is the capital of France?"


def test_factors_parse_and_split() -> None:
    assert parse_factors("1,2.5", 2) == [1.0, 2.5]
    assert split_factor(1) == (0, 0.0)
    assert split_factor(3) == (2, 0.0)
    whole, fraction = split_factor(2.5)
    assert whole == 1 and abs(fraction - 0.5) < 1e-9
    for bad in ("0.5", "nan", "inf", "x", "1,,2"):
        with pytest.raises(ExoTpError):
            parse_factors(bad)
    with pytest.raises(ExoTpError):
        parse_factors("1,2", 3)
    with pytest.raises(ExoTpError):
        check_factor(100)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.QuantizedLinear(64, 64, bias=False, group_size=32, bits=4)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down(self.up(x))


def test_slowed_matmuls_give_the_same_output_and_depend_on_every_copy() -> None:
    mx.random.seed(0)
    model = _Tiny()
    x = mx.random.uniform(-1, 1, (2, 3, 16))
    want = model(x)
    source = FactorSource(2.5)
    assert slow_down(model, source) == 2
    assert isinstance(model.up, SlowLinear) and isinstance(model.down, SlowLinear)
    got = model(x)
    assert mx.array_equal(got, want).item()  # the extra work adds an exact zero
    copies = model.up._copies.copies
    # 1.5 extra copies: one whole weight, and half the rows of another, distinct buffers
    assert [c.weight.shape[0] for c in copies] == [64, 32]
    assert model.down._copies.copies[1].weight.shape[0] == 32
    # The output depends on the extra products (MLX evaluates them): poison one copy.
    copies[1].weight = mx.full(copies[1].weight.shape, float("nan"))
    assert mx.isnan(model(x)).all().item()
    source.factor = 1.0  # changed at run time: the plain product again, no copies used
    assert mx.array_equal(model(x), want).item()
    source.factor = 3.0
    assert [c.weight.shape[0] for c in model.up._copies.for_factor(3.0)] == [64, 64]
    assert mx.array_equal(model(x), want).item()


def test_scaled_profile_scores_s_times_lower() -> None:
    seconds = 1e-3
    matvec = MatmulScore(
        kind="matvec",
        dtype="float32",
        m=1,
        k=576,
        n=1536,
        seconds=seconds,
        flops=2 * 576 * 1536 / seconds,
        weight_bytes_per_second=576 * 1536 * 4 / seconds,
        weight_bytes=576 * 1536 * 4,
        working_set_bytes=576 * 1536 * 4 * 20,
    )
    profile = DeviceProfile(
        **system_info().model_dump(),
        memory_bandwidth=1e10,
        decode_seconds_per_byte=3e-10,
        prefill_flops=4e9,
        kernels=(matvec,),
        shapes=(matvec,),  # the model's shapes, as `bench --model` adds them
    )
    slow = scaled_profile(profile, 2.0)
    assert slow.decode_seconds_per_byte == pytest.approx(2 * profile.decode_seconds_per_byte)
    assert slow.prefill_flops == pytest.approx(profile.prefill_flops / 2)
    assert slow.kernels[0].seconds == pytest.approx(2 * seconds)
    assert slow.shapes[0].seconds == pytest.approx(2 * seconds)
    assert slow.decode_score("float32").speed == pytest.approx(
        profile.decode_score("float32").speed / 2
    )
    assert scaled_profile(profile, 1.0) == profile


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["launch", "--prompt", "x", "--work-factor", "0.5,1"], "--work-factor"),
        (["launch", "--prompt", "x", "--work-factor", "1,2,3"], "3 values for 2"),
        (["launch", "--prompt", "x", "--work-factor-file", "a"], "--work-factor-file"),
        (["run", "--work-factor", "fast"], "--work-factor"),
        (["run", "--local-nodes", "2", "--work-factor", "1"], "1 values for 2"),
        (["bench", "--work-factor", "0"], "--work-factor"),
    ],
)
def test_bad_lab_flags_are_one_line(args: list[str], needle: str) -> None:
    result = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], result.stderr


def test_a_slowed_rank_generates_the_same_text(tmp_path: Path) -> None:
    plain = launch(tmp_path, MODEL, [1, 1], PROMPT, 8, logits=False)
    slowed = launch(tmp_path, MODEL, [1, 1], PROMPT, 8, "--work-factor", "1,2.5", logits=False)
    assert list(slowed.report.tokens) == list(plain.report.tokens)
    assert "lab work factor 2.5" in slowed.stderr


def test_bench_under_a_factor_scores_lower(tmp_path: Path) -> None:
    """`exo-tp bench --work-factor 3 --quick` runs the same kernels, each doing 3x the work.
    (The s-times figure itself needs a quiet machine: bench/hetero_lab.py --validate.)"""
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    slow = json.loads(
        run_cli("bench", "--quick", "--json", "--work-factor", "3", env=env).stdout.splitlines()[-1]
    )
    assert (tmp_path / "exo-tp" / "profile-work-factor-3.json").exists()
    assert not (tmp_path / "exo-tp" / "profile.json").exists()  # the real one is untouched
    assert slow["decode_seconds_per_byte"] > 0


def _decode_tps(tmp: Path, factor: float) -> float:
    result = launch(tmp, MODEL, [1], PROMPT, 24, "--work-factor", f"{factor:g}", logits=False)
    return result.report.generation_tps


@pytest.mark.slow  # bench/hetero_lab.py --validate measures the same on a quiet machine
@pytest.mark.parametrize("factor", [1.5, 2.0, 3.0])
def test_one_rank_with_factor_s_decodes_s_times_slower(tmp_path: Path, factor: float) -> None:
    """Alternating runs at factor 1 and s on the same core; medians of the ratio."""
    ratios = []
    for _ in range(3):
        base = _decode_tps(tmp_path, 1.0)
        slow = _decode_tps(tmp_path, factor)
        ratios.append(base / slow)
    assert statistics.median(ratios) == pytest.approx(factor, rel=0.10), ratios


class _Shard(nn.Module):
    """A rank's linears: ``rows`` output rows of a 64-wide layer."""

    def __init__(self, rows: int):
        super().__init__()
        self.q = nn.Linear(64, rows, bias=False)
        self.k = nn.Linear(64, rows, bias=False)
        self.v = nn.Linear(64, rows, bias=False)


def test_the_speed_probe_times_the_same_matrices_whatever_the_share() -> None:
    """The live probe's work does not depend on the rank's share (a small share timed on its own
    linears looked slower per byte, and re-plans ran away), and goes through the lab's factor
    when the model's linears do."""
    from exo_tp.runtime.speed_probe import PROBE_MATRICES, PROBE_SHAPE, SpeedProbe

    small, large = _Shard(8), _Shard(512)
    slow_down(small, FactorSource(2.5))
    probes = [SpeedProbe(small), SpeedProbe(large)]
    samples = [p.measure() for p in probes]
    assert all(s is not None for s in samples)
    probe_bytes = PROBE_MATRICES * PROBE_SHAPE[0] * PROBE_SHAPE[1] * 4
    assert [s.probe_bytes for s in samples if s] == [probe_bytes, probe_bytes]
    assert [s.shard_bytes for s in samples if s] == [3 * 64 * 8 * 4, 3 * 64 * 512 * 4]
    calls = [[type(m) for m, _ in p._calls] for p in probes]
    assert calls == [[SlowLinear] * PROBE_MATRICES, [nn.Linear] * PROBE_MATRICES]
    wrapped = probes[0]._calls[0][0]
    assert isinstance(wrapped, SlowLinear) and wrapped.source.factor == 2.5
