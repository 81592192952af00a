"""Time from a fault to the cluster's first correct answer (issue #45), one fault at a time.

Each fault gets a fresh `exo-tp run --local-nodes 3` cluster (SmolLM2, float32, equal weights,
no device measurement), serving ``--streams`` long greedy streams when it strikes:

- ``rank``: kill -9 the rank process of local-2;
- ``follower``: kill -9 the node daemon of local-2 (not the leader);
- ``leader``: kill -9 the node daemon of local-0, the leader;
- ``stall``: SIGSTOP the rank of local-2 (the cluster runs with ``--stall-timeout 6``).

From the fault on, a short greedy request goes every 0.25 s to a node that survives; the time
is the first one whose answer equals the answer the cluster gave before the fault (which the
test suite holds equal to single-device mlx-lm). The streams in flight must end, with an error
that names what died, or finish. `--local-nodes` restarts a killed daemon after 5 s, as it does
for users: the figures include what that restart does to the cluster.

    python3 bench/faults.py [--faults rank,follower,leader,stall] [--streams 6] [--quick]

``--quick``: the leader fault alone, on 2 nodes (a node start fewer: local-1 survives), with 2
streams, on a tiny random model with SmolLM2's tokenizer (bench/_common.py's ``tiny_model``).

Run it on an idle machine. The last line is JSON (seconds per fault).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx
import psutil
from _common import env, model_arg
from pydantic import BaseModel

Fault = Literal["rank", "follower", "leader", "stall"]
FAULTS: tuple[Fault, ...] = ("rank", "follower", "leader", "stall")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STALL_TIMEOUT = 6.0
READY_TIMEOUT = 300.0
ANSWER_TIMEOUT = 120.0  # a fault whose cluster never answers again counts as this


class FaultResult(BaseModel):
    fault: Fault
    first_correct_s: float | None  # None: no correct answer within ANSWER_TIMEOUT
    stream_errors: list[str]  # what the streams in flight ended with
    refusals: dict[str, int]  # what the probe requests got meanwhile, by status or error


class Result(BaseModel):
    streams: int
    seconds: dict[str, float | None]
    results: list[FaultResult]


def _free_base(count: int) -> int:
    """A port base with ``count`` free API ports above it."""
    for base in range(18400, 30000, 37):
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports")


def _chat(model: str, max_tokens: int, stream: bool = False) -> dict:
    return {
        "model": model,
        "messages": QUESTION if not stream else [{"role": "user", "content": "Tell a story."}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": stream,
    }


def _ask(url: str, model: str, timeout: float = 60.0) -> tuple[int, str]:
    """(status, the answer's text or the error body) of one short greedy request."""
    answer = httpx.post(f"{url}/v1/chat/completions", json=_chat(model, 8), timeout=timeout)
    if answer.status_code != 200:
        return answer.status_code, answer.text[:200]
    return 200, answer.json()["choices"][0]["message"]["content"]


@dataclass
class Stream:
    """One long greedy stream in a thread; how it ended."""

    url: str
    model: str
    started: threading.Event = field(default_factory=threading.Event)
    ended: str = ""
    thread: threading.Thread | None = None

    def start(self) -> Stream:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            with httpx.stream(
                "POST", f"{self.url}/v1/chat/completions", json=_chat(self.model, 600, True),
                timeout=httpx.Timeout(120.0),
            ) as answer:  # fmt: skip
                for line in answer.iter_lines():
                    self.started.set()
                    if '"error"' in line:
                        self.ended = line.removeprefix("data: ")[:200]
                        return
            self.ended = self.ended or f"finished ({answer.status_code})"
        except httpx.HTTPError as error:
            self.ended = f"{type(error).__name__}: {error}"[:200]
        finally:
            self.started.set()


class Cluster:
    def __init__(self, fault: Fault, logs: Path, nodes: int, model: str):
        self.base = _free_base(nodes)
        self.urls = [f"http://127.0.0.1:{self.base + i}" for i in range(nodes)]
        extra = ["--stall-timeout", str(STALL_TIMEOUT if fault == "stall" else 300)]
        command = [
            sys.executable, "-m", "exo_tp", "run", "--local-nodes", str(nodes),
            "--weights", ",".join(["1"] * nodes), "--api-port", str(self.base), "--model", model,
            "--rebalance", "off", *extra,
        ]  # fmt: skip
        self.log = logs / f"{fault}.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env(), start_new_session=True
            )

    def ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            try:
                plans = [httpx.get(f"{u}/v1/plan", timeout=2).json() for u in self.urls]
                if all(len(p.get("nodes") or ()) == len(self.urls) for p in plans) and all(
                    httpx.get(f"{u}/health", timeout=2).json().get("state") == "ready"
                    for u in self.urls
                ):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the cluster never got ready (see {self.log})")

    def processes(self, marker: str) -> dict[str, psutil.Process]:
        """Node id -> the process below the cluster whose command line names ``marker``."""
        out = {}
        for proc in psutil.Process(self.proc.pid).children(recursive=True):
            cmdline = proc.cmdline()
            if marker == "exo_tp.runtime.rank" and marker in cmdline:
                job = json.loads(Path(cmdline[cmdline.index(marker) + 1]).read_text())
                out[job["nodes"][job["rank"]]] = proc
            elif marker == "exo_tp.cli.node_child" and "--node-id" in cmdline:
                out[cmdline[cmdline.index("--node-id") + 1]] = proc
        return out

    def close(self) -> None:
        for proc in psutil.Process(self.proc.pid).children(recursive=True):
            if proc.status() == psutil.STATUS_STOPPED:
                proc.send_signal(signal.SIGCONT)
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _strike(cluster: Cluster, fault: Fault) -> Callable[[], None]:
    """Inject ``fault``; returns what undoes what must be undone at the end."""
    if fault == "rank":
        cluster.processes("exo_tp.runtime.rank")["local-2"].kill()
    elif fault == "stall":
        frozen = cluster.processes("exo_tp.runtime.rank")["local-2"]
        frozen.send_signal(signal.SIGSTOP)
        return lambda: frozen.is_running() and frozen.send_signal(signal.SIGCONT)
    else:
        victim = "local-0" if fault == "leader" else "local-2"
        cluster.processes("exo_tp.cli.node_child")[victim].kill()
    return lambda: None


def run_fault(fault: Fault, streams: int, logs: Path, nodes: int, model: str) -> FaultResult:
    cluster = Cluster(fault, logs, nodes, model)
    undo: Callable[[], None] = lambda: None  # noqa: E731
    try:
        cluster.ready()
        survivor = cluster.urls[1]
        status, reference = _ask(survivor, model)
        if status != 200:
            raise RuntimeError(f"the cluster did not answer before the fault: {reference}")
        running = [Stream(cluster.urls[i % nodes], model).start() for i in range(streams)]
        for s in running:
            s.started.wait(60)
        undo = _strike(cluster, fault)
        struck = time.monotonic()
        refusals: dict[str, int] = {}
        first: float | None = None
        while time.monotonic() - struck < ANSWER_TIMEOUT:
            try:
                status, text = _ask(
                    survivor, model, max(1.0, ANSWER_TIMEOUT - (time.monotonic() - struck))
                )
            except httpx.HTTPError as error:
                status, text = 0, type(error).__name__
            if status == 200 and text == reference:
                first = time.monotonic() - struck
                break
            key = str(status) if status else text
            refusals[key] = refusals.get(key, 0) + 1
            time.sleep(0.25)
        for s in running:
            if s.thread is not None:
                s.thread.join(30)
        return FaultResult(
            fault=fault,
            first_correct_s=first,
            stream_errors=[s.ended for s in running],
            refusals=refusals,
        )
    finally:
        undo()
        cluster.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--streams", type=int, default=6)
    parser.add_argument("--logs", type=Path, help="keep the clusters' logs here")
    parser.add_argument(
        "--quick", action="store_true", help="the leader fault alone, on 2 nodes, with 2 streams"
    )
    args = parser.parse_args()
    faults = [f for f in args.faults.split(",") if f]
    # Three nodes: the rank, follower and stall faults strike local-2, the leader fault local-0,
    # and local-1 survives each; the leader fault alone needs only local-0 and local-1.
    nodes = 3
    if args.quick:
        faults, args.streams, nodes = ["leader"], 2, 2
    # --quick: SmolLM2's float32 steps and loads were seconds of each (re-)formation; a random
    # model with its tokenizer takes the same paths (bench/_common.py's tiny_model).
    model = model_arg(None, args.quick)
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        parser.error(f"unknown faults {unknown}; choose from {','.join(FAULTS)}")
    logs = args.logs or Path(tempfile.mkdtemp(prefix="exo-tp-faults-"))
    logs.mkdir(parents=True, exist_ok=True)
    results = [run_fault(f, args.streams, logs, nodes, model) for f in faults]  # type: ignore[arg-type]
    print(f"{'fault':<10} {'first correct answer':>21}  meanwhile")
    for r in results:
        seconds = f"{r.first_correct_s:.1f} s" if r.first_correct_s is not None else "never"
        print(f"{r.fault:<10} {seconds:>21}  {r.refusals}")
        for ended in r.stream_errors:
            print(f"{'':<10} stream: {ended}")
    print(f"logs: {logs}", file=sys.stderr)
    result = Result(
        streams=args.streams,
        seconds={r.fault: r.first_correct_s for r in results},
        results=results,
    )
    print(result.model_dump_json())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
