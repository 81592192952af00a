"""Node daemons on this machine, started and watched by the one supervisor
(`exo_tp.process.supervisor`): `exo-tp run --local-nodes N`, the benches and the tests share
`LocalCluster`.

Each node is ``python -m exo_tp.cli.node_child`` with its typed `NodeOptions` in its
environment; it tells the supervisor Ready once its API answers. Under `LocalCluster.run` (the
CLI), a node that dies after it served is logged and restarted after a back-off (5, 10, 20, 40,
60 s; the count starts again once a node has stayed up a minute), while the others keep
serving: their leader re-plans without it, and again when it rejoins. After
`len(RESTART_DELAYS)` failed restarts in a row the cluster gives that node up; it stops when
none is left. A node that dies before it ever served (a bad model path, a taken port) is a
configuration problem: the whole cluster stops and says so.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from exo_tp.errors import ExoTpError
from exo_tp.node.options import NODE_OPTIONS_ENV, NodeOptions
from exo_tp.process.events import Exited, Failed, ProcessEvent, Ready
from exo_tp.process.messages import CHILD_EVENTS
from exo_tp.process.supervisor import Child, Job, Supervisor, clean_environment
from exo_tp.transport.ports import port_is_free

log = logging.getLogger(__name__)

# The first wait outlasts the peers' detection of the death (3 missed 1 s pings) and their
# settling, so they re-plan without the node before it comes back, not around its restart.
RESTART_DELAYS = (5.0, 10.0, 20.0, 40.0, 60.0)
STABLE_SECONDS = 60.0  # up this long: a node's restart count starts again
STOP_GRACE = 10.0  # seconds a node has to stop its worker after SIGTERM


def node_job(
    index: int,
    options: NodeOptions,
    env: Mapping[str, str] | None = None,
    log_file: Path | None = None,
) -> Job:
    """The supervisor's job for one node: ``options`` in its environment with ``env`` (the
    cluster secret and API key go there, never on a command line); its stderr to
    ``log_file`` if given."""
    return Job(
        name=f"local node {index} (port {options.api_port})",
        module="exo_tp.cli.node_child",
        # a label for `ps` (which node is which), checked by the child against its options
        argv=("--node-id", options.node_id) if options.node_id else (),
        env={**clean_environment(), **(env or {}), NODE_OPTIONS_ENV: options.model_dump_json()},
        stdout="null",
        stderr_file=str(log_file) if log_file else None,
    )


@dataclass
class LocalNode:
    index: int
    job: Job
    child: Child | None = None
    served: bool = False  # said Ready since its last start
    ever_served: bool = False
    restarts: int = 0  # restarts in a row without a stable run
    restart_at: float | None = None  # when it is dead and waits for its restart
    given_up: bool = False

    @property
    def name(self) -> str:
        return self.job.name


class LocalCluster:
    """Nodes (or any job speaking the plain child messages) on this machine. Add them with
    `start`; `run` supervises them with the restart policy until none is left; leaving the
    `with` block stops them all (SIGTERM, then SIGKILL after `STOP_GRACE` seconds)."""

    def __init__(self, restart_delays: Sequence[float] | None = None) -> None:
        self.restart_delays = tuple(RESTART_DELAYS if restart_delays is None else restart_delays)
        self.nodes: list[LocalNode] = []
        self._events: queue.Queue[tuple[Child, ProcessEvent]] = queue.Queue()
        self._supervisor = Supervisor(
            lambda child, event: self._events.put((child, event)), CHILD_EVENTS, name="nodes"
        )

    def start(self, job: Job) -> LocalNode:
        node = LocalNode(len(self.nodes), job)
        self.nodes.append(node)
        self._start(node)
        return node

    def _start(self, node: LocalNode) -> None:
        node.child = self._supervisor.start(node.job)
        node.served, node.restart_at = False, None

    def _node(self, child: Child) -> LocalNode | None:
        return next((n for n in self.nodes if n.child is child), None)

    def wait_ready(self, nodes: Sequence[LocalNode], timeout: float) -> None:
        """Until each of ``nodes`` said Ready; raises ExoTpError if one dies first, or at
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not all(n.served for n in nodes):
            try:
                child, event = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                late = [n.name for n in nodes if not n.served]
                raise ExoTpError(f"{late} not serving after {timeout:g}s") from None
            node = self._node(child)
            if node is None:
                continue
            if isinstance(event, Ready):
                node.served = node.ever_served = True
            elif isinstance(event, Failed | Exited) and node in nodes:
                raise _never_served(node, event)

    def run(self) -> None:
        """Supervise until every node is given up (raises ExoTpError then, or at once when a
        node dies before it ever served)."""
        while not all(node.given_up for node in self.nodes):
            waits = [n.restart_at for n in self.nodes if n.restart_at is not None]
            timeout = max(0.0, min(waits) - time.monotonic()) if waits else None
            try:
                child, event = self._events.get(timeout=timeout)
            except queue.Empty:
                pass
            else:
                if (node := self._node(child)) is not None:
                    self._handle(node, event, time.monotonic())
            self._restart_due(time.monotonic())
        raise ExoTpError("every local node failed")

    def _handle(self, node: LocalNode, event: ProcessEvent, now: float) -> None:
        if isinstance(event, Ready):
            node.served = node.ever_served = True
            return
        if not isinstance(event, Failed | Exited) or (
            isinstance(event, Failed) and event.reason == "stall"
        ):
            return
        why = _why(event)
        if not node.ever_served:
            raise _never_served(node, event)
        assert node.child is not None
        if node.served and now - node.child.started > STABLE_SECONDS:
            node.restarts = 0
        if node.restarts >= len(self.restart_delays):
            node.given_up = True
            log.error("%s %s; giving up after %d restarts", node.name, why, node.restarts)
            return
        delay = self.restart_delays[node.restarts]
        log.warning(
            "%s %s; the other nodes keep serving; restarting it in %.0f s", node.name, why, delay
        )
        node.restart_at = now + delay

    def _restart_due(self, now: float) -> None:
        for node in self.nodes:
            if node.restart_at is not None and now >= node.restart_at:
                node.restarts += 1
                log.info(
                    "restarting %s (attempt %d of %d)",
                    node.name,
                    node.restarts,
                    len(self.restart_delays),
                )
                self._start(node)

    def stop(self, node: LocalNode) -> None:
        if node.child is not None:
            self._supervisor.stop(node.child, STOP_GRACE)

    def close(self) -> None:
        self._supervisor.close(STOP_GRACE)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()


def _never_served(node: LocalNode, event: Failed | Exited) -> ExoTpError:
    if isinstance(event, Failed) and event.reason == "error" and node.child is not None:
        return ExoTpError(f"{node.name} failed before it served: {node.child.reported}")
    return ExoTpError(f"{node.name} {_why(event)} before it served; see its log above")


def _why(event: Failed | Exited) -> str:
    return event.message if isinstance(event, Failed) else "exited with code 0"


def run_local_cluster(nodes: Sequence[NodeOptions], env: Mapping[str, str]) -> int:
    """`exo-tp run --local-nodes`: run and supervise ``nodes`` until interrupted. ``env``: added
    to each node's environment (the cluster secret and API key)."""
    ports = [options.api_port for options in nodes]
    taken = [p for p in ports if not port_is_free(p)]
    if taken:
        raise ExoTpError(f"API ports {taken} are in use; pick another --api-port")
    with LocalCluster() as cluster:
        for i, options in enumerate(nodes):
            cluster.start(node_job(i, options, env))
        print(
            f"local cluster {nodes[0].cluster!r} of {len(nodes)} nodes: "
            + ", ".join(f"http://127.0.0.1:{p}" for p in ports),
            flush=True,
        )
        cluster.run()
    return 0
