"""Idle connections must not slow real requests down (issue #21, point 6).

Starts `exo-tp run --local-nodes NODES` (SmolLM2, float32, equal weights) and measures, on the
first node's API, the latency of real requests (greedy chat completions of ``--max-tokens``
tokens, ``--active`` clients sending back to back) twice:

  base    no other connection open;
  loaded  with ``--idle`` connections held open to the same node meanwhile: each made one
          request (GET /health) and then stays idle in keep-alive, from several loopback
          addresses (so that no per-address cap refuses them); one the node closes (its
          --keepalive-timeout) is opened again at once, so the count holds throughout.

The phases alternate (``--rounds``), so that a shared machine's drifting load does not count
as the idle connections' cost. Prints p50 / p95 of each phase and their ratio; the target is
loaded p95 <= 1.2x base p95 at ``--idle 1000``. The last line of stdout is one JSON object.

    python bench/conn_load.py [--idle 1000] [--active 2] [--requests 12] [--max-tokens 4]
        [--nodes 2] [--logs DIR] [--quick]

``--quick``: a smoke run (1 node, 20 idle connections, 1 request per client and phase, 1 token,
one round); it checks the bench runs and measures nothing worth reporting.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import env  # noqa: E402

PER_ADDRESS = 200  # idle connections per loopback source address (the node's cap is 256)


def _free_base(count: int) -> int:
    import socket

    for base in range(31000, 40000, 53):
        ok = True
        for port in range(base, base + count):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free ports")


def _ready(url: str, nodes: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/v1/plan", timeout=5) as r:
                plan = json.loads(r.read())
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                health = json.loads(r.read())
            if health["state"] == "ready" and len(plan.get("nodes") or []) == nodes:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(1)
    raise TimeoutError("cluster not ready")


class Idle:
    """``count`` idle keep-alive connections to ``port``, re-opened as the node closes them."""

    def __init__(self, port: int, count: int):
        self.port, self.count = port, count
        self.open = 0
        self.reopened = 0
        self._tasks: list[asyncio.Task[None]] = []

    async def _hold(self, source: str) -> None:
        while True:
            try:
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", self.port, local_addr=(source, 0)
                )
            except OSError:
                await asyncio.sleep(0.5)
                continue
            self.open += 1
            try:
                writer.write(b"GET /health HTTP/1.1\r\nHost: bench\r\n\r\n")
                await reader.read(65536)  # the answer; then idle until the node closes it
                while await reader.read(65536):
                    pass
            except OSError:
                pass
            finally:
                self.open -= 1
                writer.close()
            self.reopened += 1

    async def start(self) -> None:
        for i in range(self.count):
            source = f"127.0.0.{2 + i // PER_ADDRESS}"
            self._tasks.append(asyncio.create_task(self._hold(source)))
        deadline = time.monotonic() + 60
        while self.open < self.count and time.monotonic() < deadline:
            await asyncio.sleep(0.2)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _requests(url: str, active: int, per_client: int, max_tokens: int) -> list[float]:
    import aiohttp

    latencies: list[float] = []

    async def client(c: int) -> None:
        async with aiohttp.ClientSession() as session:
            for r in range(per_client):
                body = {
                    "messages": [{"role": "user", "content": f"Count to {c * 100 + r}."}],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                }
                started = time.monotonic()
                async with session.post(url + "/v1/chat/completions", json=body) as response:
                    await response.read()
                    if response.status != 200:
                        raise RuntimeError(f"HTTP {response.status}")
                latencies.append(time.monotonic() - started)

    await asyncio.gather(*(client(c) for c in range(active)))
    return latencies


def _pcts(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]
    return {"p50": statistics.median(ordered), "p95": p95, "n": len(ordered)}


async def _measure(args: argparse.Namespace, url: str, port: int) -> dict[str, object]:
    await _requests(url, 1, 1, args.max_tokens)  # warm up (first prefill, caches)
    base: list[float] = []
    loaded: list[float] = []
    idle = Idle(port, args.idle)
    held = still = 0
    # Alternating rounds: a shared machine's load drifts, and must not count as the idle
    # connections' cost.
    per_round = max(1, args.requests // args.rounds)
    for _ in range(args.rounds):
        base += await _requests(url, args.active, per_round, args.max_tokens)
        idle = Idle(port, args.idle)
        await idle.start()
        held = idle.open
        try:
            loaded += await _requests(url, args.active, per_round, args.max_tokens)
            still = idle.open
        finally:
            await idle.stop()
    b, lo = _pcts(base), _pcts(loaded)
    return {
        "idle": args.idle,
        "idle_open_at_start": held,
        "idle_open_at_end": still,
        "idle_reopened": idle.reopened,
        "active": args.active,
        "base": b,
        "loaded": lo,
        "p50_ratio": lo["p50"] / b["p50"],
        "p95_ratio": lo["p95"] / b["p95"],
        "target_p95_ratio": 1.2,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--idle", type=int, default=1000)
    p.add_argument("--active", type=int, default=2)
    p.add_argument("--requests", type=int, default=12, help="requests per active client")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="alternating base/loaded rounds")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--logs", type=Path)
    p.add_argument("--quick", action="store_true", help="a smoke run (tiny settings)")
    args = p.parse_args()
    if args.quick:
        args.idle, args.requests, args.max_tokens, args.rounds, args.nodes = 20, 1, 1, 1, 1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = args.idle + 256
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))
    base = _free_base(args.nodes)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="conn-load-"))
    logs.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "exo_tp",
        "run",
        "--local-nodes",
        str(args.nodes),
        "--weights",
        ",".join(["1"] * args.nodes),
        "--api-port",
        str(base),
        "--dtype",
        "float32",
    ]
    with (logs / "cluster.log").open("w") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env(), start_new_session=True
        )
    url = f"http://127.0.0.1:{base}"
    try:
        _ready(url, args.nodes)
        result = asyncio.run(_measure(args, url, base))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    b, lo = result["base"], result["loaded"]
    print(f"base    p50 {b['p50']:.3f} s  p95 {b['p95']:.3f} s  ({b['n']} requests)")  # type: ignore[index]
    print(
        f"loaded  p50 {lo['p50']:.3f} s  p95 {lo['p95']:.3f} s  with {args.idle} idle "  # type: ignore[index]
        f"connections ({result['idle_open_at_start']} open at start)"
    )
    print(f"p95 ratio {result['p95_ratio']:.2f} (target <= 1.2)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
