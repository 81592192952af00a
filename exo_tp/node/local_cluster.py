"""`exo-tp run --local-nodes N`: a whole cluster of N node daemons on this machine.

The launcher supervises its nodes. One that dies after it served is logged and restarted after
a back-off (5, 10, 20, 40, 60 s; the count starts again once a node has stayed up a minute),
while the others keep serving: their leader re-plans without it, and again when it rejoins.
After `len(RESTART_DELAYS)` failed restarts in a row the launcher gives that node up; it stops
when none is left. A node that dies before it ever served (a bad model path, a taken port) is a
configuration problem: the launcher stops the whole cluster and says so.
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from exo_tp.errors import ExoTpError
from exo_tp.transport.ports import port_is_free

log = logging.getLogger(__name__)

# The first wait outlasts the peers' detection of the death (3 missed 1 s pings) and their
# settling, so they re-plan without the node before it comes back, not around its restart.
RESTART_DELAYS = (5.0, 10.0, 20.0, 40.0, 60.0)
STABLE_SECONDS = 60.0  # up this long: a node's restart count starts again
POLL_SECONDS = 0.5


@dataclass
class LocalNode:
    index: int
    port: int
    args: list[str]
    proc: subprocess.Popen | None = None
    started: float = 0.0
    served: bool = False  # answered /health since its last start
    ever_served: bool = False
    restarts: int = 0  # restarts in a row without a stable run
    restart_at: float | None = None  # when it is dead and waits for its restart
    given_up: bool = False

    @property
    def name(self) -> str:
        return f"local node {self.index} (port {self.port})"

    def start(self, env: Mapping[str, str]) -> None:
        self.proc = subprocess.Popen(self.args, env={**os.environ, **env})
        self.started, self.served, self.restart_at = time.monotonic(), False, None

    def answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1):
                return True
        except OSError:
            return False


def _watch(node: LocalNode, env: Mapping[str, str], now: float) -> None:
    """One supervision step for one node."""
    if node.given_up:
        return
    if node.restart_at is not None:
        if now >= node.restart_at:
            node.restarts += 1
            log.info(
                "restarting %s (attempt %d of %d)", node.name, node.restarts, len(RESTART_DELAYS)
            )
            node.start(env)
        return
    assert node.proc is not None
    code = node.proc.poll()
    if code is None:
        if not node.served and node.answers():
            node.served = node.ever_served = True
        if node.restarts and node.served and now - node.started > STABLE_SECONDS:
            node.restarts = 0
        return
    if not node.ever_served:
        raise ExoTpError(f"{node.name} exited with code {code} before it served; see its log above")
    if node.restarts >= len(RESTART_DELAYS):
        node.given_up = True
        log.error(
            "%s exited with code %d; giving up after %d restarts", node.name, code, node.restarts
        )
        return
    delay = RESTART_DELAYS[node.restarts]
    log.warning(
        "%s exited with code %d; the other nodes keep serving; restarting it in %.0f s",
        node.name,
        code,
        delay,
    )
    node.restart_at = now + delay


def run_local_cluster(
    count: int,
    weights: Sequence[float] | None,
    models: Sequence[str],
    api_port: int,
    dtype: str,
    env: Mapping[str, str],
    extra: Sequence[str] = (),
    profiles: Sequence[Path] | None = None,
    node_args: Sequence[Sequence[str]] | None = None,
) -> int:
    """Run and supervise the nodes until interrupted. ``env``: added to each node's
    environment (the cluster secret and API key go there, never on a command line)."""
    if weights is not None and len(weights) != count:
        raise ExoTpError(f"--weights has {len(weights)} values for {count} local nodes")
    ports = [api_port + i for i in range(count)]
    taken = [p for p in ports if not port_is_free(p)]
    if taken:
        raise ExoTpError(f"API ports {taken} are in use; pick another --api-port")
    cluster = f"local-{secrets.token_hex(4)}"
    nodes = []
    for i, port in enumerate(ports):
        args = [
            sys.executable,
            "-m",
            "exo_tp",
            "run",
            "--host",
            "127.0.0.1",
            "--api-port",
            str(port),
            "--node-id",
            f"local-{i}",
            "--cluster",
            cluster,
            *(arg for model in models for arg in ("--model", model)),
            "--dtype",
            dtype,
            *extra,
        ]
        if weights is not None:
            args += ["--weight", str(weights[i])]
        if profiles is not None:
            args += ["--profile", str(profiles[i])]
        if node_args is not None:  # per node (the lab's work factors)
            args += node_args[i]
        nodes.append(LocalNode(i, port, args))
    try:
        for node in nodes:
            node.start(env)
        print(
            f"local cluster {cluster!r} of {count} nodes: "
            + ", ".join(f"http://127.0.0.1:{p}" for p in ports),
            flush=True,
        )
        while not all(node.given_up for node in nodes):
            now = time.monotonic()
            for node in nodes:
                _watch(node, env, now)
            time.sleep(POLL_SECONDS)
        raise ExoTpError("every local node failed")
    finally:
        running = [n.proc for n in nodes if n.proc is not None and n.proc.poll() is None]
        for proc in running:
            proc.terminate()
        for proc in running:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
