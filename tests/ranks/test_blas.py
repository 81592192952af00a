"""The BLAS that MLX's CPU build multiplies with (exo_tp.process.blas): the system's OpenBLAS,
preloaded into every process `exo-tp` starts when the system has it, each rank with its part of
the cores; MLX's bundled one with ``EXO_TP_BLAS=bundled``. Either way the text equals
single-device mlx-lm's, computed in this process (on OpenBLAS too: tests/conftest.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from helpers import Reference, assert_logits_close, launch, mlx_lm_reference, run_cli

from exo_tp.process.blas import PRELOADED_ENV, blas_library, group_threads

PROMPT = "Write a short poem about the sea."
TOKENS = 24
needs_openblas = pytest.mark.skipif(
    blas_library("auto") is None, reason="no OpenBLAS on this machine (.ci/install adds it)"
)


@pytest.fixture(scope="module")
def reference(default_models: dict[str, Path]) -> Reference:
    return mlx_lm_reference(default_models["smollm2-135m"], PROMPT, TOKENS)


def _blas_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "float32 matmuls on" in line]


@needs_openblas
def test_ranks_multiply_with_openblas_and_equal_single_device(
    tmp_path: Path, reference: Reference
) -> None:
    ours = launch(tmp_path, "smollm2-135m", [0.6, 0.4], PROMPT, TOKENS)
    assert list(ours.report.tokens) == reference.tokens
    assert_logits_close(ours.logits, reference.logits)
    # Each rank says where its process's cblas_sgemm lives (read from its own memory map) and
    # how many threads OpenBLAS runs: the two ranks split this machine's cores.
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    lines = _blas_lines(ours.stderr)
    assert len(lines) == 2, ours.stderr
    for line in lines:
        assert "libopenblas" in line and f"({threads} thread" in line, line


def test_bundled_blas_on_request(tmp_path: Path, reference: Reference) -> None:
    ours = launch(
        tmp_path,
        "smollm2-135m",
        [0.6, 0.4],
        PROMPT,
        8,
        logits=False,
        env={"EXO_TP_BLAS": "bundled"},
    )
    assert list(ours.report.tokens) == reference.tokens[:8]
    lines = _blas_lines(ours.stderr)
    assert len(lines) == 2 and all("MLX's bundled BLAS" in line for line in lines), ours.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="preloading is Linux's")
@pytest.mark.parametrize("setting", ["/no/such/libblas.so", "/etc/hostname"])
def test_a_bad_blas_setting_is_one_readable_line(setting: str) -> None:
    result = run_cli("--version", check=False, env={"EXO_TP_BLAS": setting})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr
    assert "EXO_TP_BLAS" in result.stderr and "Traceback" not in result.stderr


def test_ranks_on_one_host_split_its_cores() -> None:
    cores = len(os.sched_getaffinity(0))
    env = {PRELOADED_ENV: "libopenblas.so.0"}
    hosts = ["10.0.0.1:5000", "10.0.0.1:5001", "10.0.0.2:5000"]
    assert group_threads(hosts, 0, env) == {"OPENBLAS_NUM_THREADS": str(max(1, cores // 2))}
    assert group_threads(hosts, 2, env) == {"OPENBLAS_NUM_THREADS": str(cores)}
    # The user's own count wins; without OpenBLAS there is nothing to set.
    assert group_threads(hosts, 0, {**env, "OPENBLAS_NUM_THREADS": "3"}) == {}
    assert group_threads(hosts, 0, {}) == {}
