"""The `exo-tp` command line: readable one-line errors, and no hang when a rank dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import CLI, run_cli, wait_gone


def _one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("exo-tp: error:")
    return lines[0]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["launch", "--ranks", "0", "--prompt", "x"], "--ranks"),
        (["launch", "--ranks", "two", "--prompt", "x"], "whole number"),
        (["launch", "--ranks", "2", "--weights", "1,2,3", "--prompt", "x"], "3 values for 2"),
        (["launch", "--ranks", "2", "--weights", "1,-1", "--prompt", "x"], "weights"),
        (["launch", "--ranks", "2", "--weights", "a,b", "--prompt", "x"], "numbers"),
        (["launch", "--ranks", "2", "--weights", "0,0", "--prompt", "x"], "positive"),
        (
            ["launch", "--ranks", "3", "--stages", "2,1", "--weights", "5,3,0", "--prompt", "x"],
            "stage 2 has no speed",
        ),
        (["launch", "--model", "no-such-model", "--prompt", "x"], "unknown model"),
        (["launch", "--prompt", "x", "--max-tokens", "0"], "--max-tokens"),
        (["launch", "--prompt", "x", "--temp", "-1"], "--temp"),
        (["launch", "--prompt", "x", "--top-p", "2"], "top-p"),
        (["launch", "--ranks", "2"], "--prompt"),
        (["launch", "--prompt", "x", "--kv-bits", "8", "--kv-group-size", "128"], "head width 64"),
        (["launch", "--prompt", "x", "--kv-bits", "7"], "--kv-bits"),
        (["plan", "--model", "/nonexistent/folder"], "unknown model"),
        (["model", "path", "nope"], "unknown model"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_is_one_readable_line(args: list[str], needle: str) -> None:
    line = _one_line_error(run_cli(*args, check=False, timeout=120))
    assert needle in line


def test_model_folder_without_config(tmp_path: Path) -> None:
    line = _one_line_error(run_cli("plan", "--model", str(tmp_path), check=False))
    assert "config.json" in line


@pytest.mark.parametrize("command", [["plan"], ["launch", "--ranks", "2", "--prompt", "x"]])
def test_unknown_architecture_is_named_with_the_supported_ones(
    tmp_path: Path, command: list[str]
) -> None:
    from exo_tp.arch import supported_model_types

    # A type mlx-lm lacks (every type it has runs: split, as stages, or whole on one node).
    config = {"model_type": "no_such_lm", "hidden_size": 64, "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    line = _one_line_error(run_cli(*command, "--model", str(tmp_path), check=False))
    assert "'no_such_lm'" in line
    assert all(t in line for t in supported_model_types())


def test_untabled_architecture_in_one_tensor_parallel_stage_is_refused_with_why(
    tmp_path: Path,
) -> None:
    # mamba: a real mlx-lm type with no table; its layers run as stages, never split
    config = {
        "model_type": "mamba",
        "hidden_size": 64,
        "intermediate_size": 128,
        "state_size": 16,
        "num_hidden_layers": 2,
        "vocab_size": 100,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = ["launch", "--ranks", "2", "--stages", "2", "--prompt", "x", "--model", str(tmp_path)]
    line = _one_line_error(run_cli(*args, check=False))
    assert "no tensor-parallel table for mamba" in line and "stages" in line


def test_a_clean_launch_prints_nothing_error_looking(default_models: dict[str, Path]) -> None:
    """The ranks of a finished job leave together and silently: MLX's ring logs every peer
    that closed its socket first ("[ring] Socket 7 was closed by the peer"), and one barrier
    before silencing left 2 launches of 6 printing a dozen such lines after a right answer (a
    race: this check can miss it, it cannot pass on a launch that printed them)."""
    for _ in range(3):
        args = ["launch", "--ranks", "3", "--weights", "5,3,2", "--max-tokens", "4"]
        done = run_cli(*args, "--prompt", "What is the capital of France?")
        noise = [line for line in done.stderr.splitlines() if " INFO " not in f" {line}"]
        assert noise == [], done.stderr


def test_model_path_prints_prepared_folder(default_models: dict[str, Path]) -> None:
    out = run_cli("model", "path", "smollm2-135m-q4").stdout.strip()
    assert Path(out) == default_models["smollm2-135m-q4"]
    assert (Path(out) / "config.json").is_file()


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _rank_of(pid: int) -> int | None:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    for item in env:
        if item.startswith(b"MLX_RANK="):
            return int(item.split(b"=", 1)[1])
    return None


def test_dead_rank_stops_the_job_with_a_clear_error(default_models: dict[str, Path]) -> None:
    """Kill one rank mid-generation: the launcher reports it within 10 s and leaves no ranks."""
    launcher = subprocess.Popen(
        [
            *CLI,
            "launch",
            "--ranks",
            "3",
            "--weights",
            "5,3,2",
            "--prompt",
            "Write a very long story about a lighthouse keeper.",
            "--max-tokens",
            "2000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert launcher.stdout is not None
        first = launcher.stdout.read(1)  # generation has started on every rank
        assert first, launcher.stderr.read() if launcher.stderr else ""
        workers = _children(launcher.pid)
        victim = next(pid for pid in workers if _rank_of(pid) == 1)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = launcher.communicate(timeout=30)
        elapsed = time.monotonic() - killed_at
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert elapsed < 10, f"took {elapsed:.1f}s to notice"
    assert launcher.returncode != 0
    assert "Traceback" not in stderr.splitlines()[-1]
    assert "exo-tp: error: rank 1 exited" in stderr
    # The ranks die with the launcher (PR_SET_PDEATHSIG): wait for exactly that, a bounded time.
    assert not wait_gone(workers, timeout=10), "ranks outlived the launcher"


def test_ctrl_c_stops_a_launch_without_a_rank_traceback(default_models: dict[str, Path]) -> None:
    """A terminal's Ctrl-C reaches the whole process group: the ranks leave when the launcher
    stops them (they printed a KeyboardInterrupt traceback each), and no rank is left."""
    launcher = subprocess.Popen(
        [*CLI, "launch", "--ranks", "2", "--weights", "3,2", "--max-tokens", "2000"]
        + ["--prompt", "Write a very long story about a lighthouse keeper."],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    try:
        assert launcher.stdout is not None
        assert launcher.stdout.read(1)  # generation has started on every rank
        ranks = _children(launcher.pid)
        os.killpg(launcher.pid, signal.SIGINT)
        _, stderr = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert "Traceback" not in stderr, stderr
    assert wait_gone(ranks, 15) == []
