"""Test helpers: run the real CLI, and compute independent single-device mlx-lm references."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from exo_tp.runtime.launcher import LaunchReport

CLI = [sys.executable, "-m", "exo_tp"]


def _running(proc: psutil.Process) -> bool:
    """Alive and not a zombie: an exited process whose new parent (an init that may never reap,
    as in some containers) has not reaped it is dead for every purpose here."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until every process in ``pids`` has exited (zombies count as exited); returns the
    pids still running after ``timeout`` seconds, so the caller asserts on what it waited for."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    deadline = time.monotonic() + timeout
    while True:
        _, alive = psutil.wait_procs(procs, timeout=0.1)
        procs = [p for p in alive if _running(p)]
        if not procs or time.monotonic() > deadline:
            return [p.pid for p in procs]


def run_cli(
    *args: str, timeout: float = 600, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run `exo-tp` (``env``: variables added to this process's environment)."""
    result = subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env} if env else None,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"exo-tp {' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return result


@dataclass
class LaunchResult:
    text: str
    stderr: str
    report: LaunchReport
    logits: np.ndarray | None


def launch(
    tmp: Path,
    model: str | Path,
    weights: list[float],
    prompt: str,
    max_tokens: int,
    *extra: str,
    logits: bool = True,
    env: dict[str, str] | None = None,
) -> LaunchResult:
    report, logits_file = tmp / "report.json", tmp / "logits.npy"
    args = [
        "launch",
        "--ranks",
        str(len(weights)),
        "--weights",
        ",".join(map(str, weights)),
        "--model",
        str(model),
        "--prompt",
        prompt,
        "--max-tokens",
        str(max_tokens),
        "--report-out",
        str(report),
        *extra,
    ]
    if logits:
        args += ["--logits-out", str(logits_file)]
    result = run_cli(*args, env=env)
    return LaunchResult(
        result.stdout,
        result.stderr,
        LaunchReport.model_validate_json(report.read_text()),
        np.load(logits_file) if logits else None,
    )


@dataclass
class Reference:
    tokens: list[int]
    text: str
    # Gap between the two most likely tokens at each greedy step: a mismatch where it is tiny
    # may be fp32 noise deciding a near-tie; where it is not, it is a bug.
    margins: list[float]
    # The prompt's logits cost a second prefill (as slow as decoding on this CPU): computed
    # only for the tests that read them.
    prompt_logits: Callable[[], np.ndarray]
    # The prompt's token ids (chat template applied as mlx-lm's generate does)
    prompt_ids: list[int]

    @functools.cached_property
    def logits(self) -> np.ndarray:
        """(prompt_len, vocab) for the prompt tokens."""
        return self.prompt_logits()


@functools.lru_cache(maxsize=4)
def _single_device(model_dir: str) -> tuple:
    """mlx-lm's own model and tokenizer in float32, loaded once per test session."""
    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = load(model_dir)
    model.set_dtype(mx.float32)
    return model, tokenizer


_references: dict[str, Reference] = {}


def mlx_lm_reference(
    model_dir: Path,
    prompt: str,
    max_tokens: int,
    chat_template: bool = True,
    messages: list[dict[str, str]] | None = None,
) -> Reference:
    """What single-device mlx-lm computes (float32), built only from mlx-lm's own API
    (``messages``: a whole conversation instead of one user ``prompt``); each once per test
    session (several modules ask the same question)."""
    key = json.dumps([str(model_dir), prompt, max_tokens, chat_template, messages])
    if key not in _references:
        _references[key] = _reference(model_dir, prompt, max_tokens, chat_template, messages)
    return _references[key]


def _reference(
    model_dir: Path,
    prompt: str,
    max_tokens: int,
    chat_template: bool,
    messages: list[dict[str, str]] | None,
) -> Reference:
    import mlx.core as mx
    from mlx_lm import stream_generate

    model, tokenizer = _single_device(str(model_dir))
    if chat_template:
        text = tokenizer.apply_chat_template(
            messages or [{"role": "user", "content": prompt}],
            tokenize=False,
            add_generation_prompt=True,
        )
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = tokenizer.encode(prompt)
    tokens, out, margins = [], "", []
    for response in stream_generate(model, tokenizer, mx.array(ids), max_tokens=max_tokens):
        tokens.append(response.token)
        out += response.text
        top2 = np.partition(np.array(response.logprobs.astype(mx.float32)), -2)[-2:]
        margins.append(float(top2[1] - top2[0]))
    return Reference(
        tokens,
        out,
        margins,
        lambda: np.array(model(mx.array(ids)[None]).astype(mx.float32)[0]),
        list(ids),
    )


def assert_logits_close(ours: np.ndarray, ref: np.ndarray, atol: float | None = None) -> None:
    """fp32 agreement, scaled to the logits' size (or within ``atol``).

    Reordering one sum in one process (what a row-parallel split does) already moves SmolLM2's
    logits (|logit| up to ~35) by 1.1e-4 to 1.6e-4, so the bound is 1e-4 per 10 units of
    logit scale (1e-5 relative), never looser than 1e-4 for small logits.
    """
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    bound = atol if atol is not None else 1e-5 * max(10.0, float(np.abs(ref).max()))
    diff = float(np.abs(ours - ref).max())
    assert diff <= bound, f"max |logit diff| {diff:.3g} > {bound:.3g}"


def tcp_loopback_reference() -> tuple[float, float]:
    """Independent loopback figures: one-way latency of a 4 KB TCP ping-pong, and the rate of
    an 8 MB one-way TCP transfer."""
    server = socket.create_server(("127.0.0.1", 0))
    small, large = 4096, 8 * 2**20

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            for _ in range(50):
                data = b""
                while len(data) < small:
                    data += conn.recv(small - len(data))
                conn.sendall(data)
            got = 0
            while got < large:
                got += len(conn.recv(1 << 20))
            conn.sendall(b"k")

    thread = threading.Thread(target=echo)
    thread.start()
    with socket.create_connection(server.getsockname()) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        trips = []
        for _ in range(50):
            start = time.perf_counter()
            conn.sendall(b"x" * small)
            data = b""
            while len(data) < small:
                data += conn.recv(small - len(data))
            trips.append(time.perf_counter() - start)
        start = time.perf_counter()
        conn.sendall(b"y" * large)
        conn.recv(1)
        rate = large / (time.perf_counter() - start)
    thread.join()
    server.close()
    return statistics.median(trips) / 2, rate


def assert_latency_in_seconds(latency: float, tcp_one_way: float) -> None:
    """A measured one-way loopback latency is in seconds, not ms or µs: no faster than a tenth
    of plain TCP's on the same loopback, and under 10 ms. Only unit mistakes are caught: on a
    busy 2-core VM a ring ping-pong measured 30 µs to 1.6 ms (5x to 250x TCP's)."""
    assert tcp_one_way / 10 < latency < 0.01, (latency, tcp_one_way)


def loss_recorder() -> Any:
    """An mlx-lm ``TrainingCallback`` keeping every reported loss (``.train``, ``.val``), for
    the single-device ``mlx_lm lora`` references."""
    from mlx_lm.tuner.callbacks import TrainingCallback

    class Losses(TrainingCallback):
        def __init__(self) -> None:
            self.train: list[float] = []
            self.val: list[float] = []

        def on_train_loss_report(self, info: dict[str, Any]) -> None:
            self.train.append(info["train_loss"])

        def on_val_loss_report(self, info: dict[str, Any]) -> None:
            self.val.append(info["val_loss"])

    return Losses()


def greedy_batch(model: Any, tokenizer: Any, prompt_cache_size: int) -> Any:
    """The runtime's `LockstepBatch` over a single-device model, sampling greedily (an argmax
    per row), batching up to 4 sequences: how the in-process batching tests drive it."""
    import mlx.core as mx

    from exo_tp.runtime.batching import LockstepBatch
    from exo_tp.wire.assignment import ServingOptions

    return LockstepBatch(
        model,
        tokenizer.eos_token_ids,
        ServingOptions(max_concurrency=4, prompt_cache_size=prompt_cache_size),
        lambda logprobs: (mx.argmax(logprobs, axis=-1).astype(mx.uint32), 0),
        bytes_per_token=0,
    )
