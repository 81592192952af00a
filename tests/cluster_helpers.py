"""Start real exo-tp clusters for tests: local (loopback) or one node per network namespace."""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from openai import APIError, OpenAI
from pydantic import ValidationError

from exo_tp.cli.run import options_from_flags
from exo_tp.node.cluster.views import ClusterView, HealthView, PlanView
from exo_tp.node.local_cluster import LocalCluster as SupervisedNodes
from exo_tp.node.local_cluster import node_job
from exo_tp.transport.ports import port_is_free
from exo_tp.transport.ring_wait import WAIT_ENV

CLI = [sys.executable, "-m", "exo_tp"]


def until(check: Callable[[], Any], what: str, timeout: float = 180) -> Any:
    """``check()`` once it is truthy (polled every 0.2 s: the state is another process's);
    AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout} s")
        time.sleep(0.2)
    return value


def http_json(
    url: str, body: Any = None, timeout: float = 5, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    data = (
        None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    )
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def wait_ready(
    urls: list[str],
    timeout: float = 180,
    nodes: int | None = None,
    headers: dict[str, str] | None = None,
    logs: Sequence[Path] = (),
) -> None:
    """Until every node says the cluster serves (and, if given, spans ``nodes`` ranks).
    ``headers``: sent with each request (an API key); ``logs``: the nodes' logs, whose ends
    the timeout's error shows beside the leader's last reason (why a cluster never formed is
    in them, and CI keeps nothing else)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            states = [
                HealthView.model_validate(http_json(f"{u}/health", timeout=2)[1]).state
                for u in urls
            ]
            plans = [
                PlanView.model_validate(http_json(f"{u}/v1/plan", timeout=2, headers=headers)[1])
                for u in urls
            ]
            if all(s == "ready" for s in states) and (
                nodes is None or all(len(p.nodes) == nodes for p in plans)
            ):
                return
            # why not yet, as the leader says it (a failed epoch names its rank and cause)
            view = http_json(f"{urls[0]}/v1/cluster", timeout=2, headers=headers)[1]
            last = (states, [p.nodes for p in plans], ClusterView.model_validate(view).state_reason)
        except (OSError, ValidationError, json.JSONDecodeError) as error:
            last = error
        time.sleep(0.5)
    raise TimeoutError(f"cluster not ready after {timeout}s: {last}{log_tails(logs)}")


def log_tails(logs: Sequence[Path], lines: int = 40) -> str:
    """The last ``lines`` lines of each log, headed by its name."""
    parts = []
    for path in logs:
        with suppress(OSError):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"\n--- the end of {path.name} ---\n" + "\n".join(tail))
    return "".join(parts)


def free_port_base(count: int) -> int:
    # From a random start: test runs side by side (several checkouts on one machine) would
    # otherwise race for the same first free range.
    start = 18000 + 97 * random.randrange(100)
    for base in [*range(start, 30000, 97), *range(18000, start, 97)]:
        if all(port_is_free(base + i) for i in range(count)):
            return base
    raise RuntimeError("no free port range")


@dataclass
class LocalCluster:
    """`exo-tp run --local-nodes` (the CLI's `exo_tp.node.local_cluster.LocalCluster` inside)."""

    urls: list[str]
    proc: subprocess.Popen
    log: Path  # the nodes' stderr (one file for the whole cluster)


def roles(cluster: LocalCluster) -> tuple[int, int, int]:
    """Indexes in ``cluster.urls`` of a 3-node cluster's leader, a non-leader and the third."""
    leader = http_json(cluster.urls[0] + "/v1/cluster")[1]["leader"]
    first = int(leader.rsplit("-", 1)[1])
    others = [i for i in range(3) if i != first]
    return first, others[0], others[1]


def wait_for_log(log: Path, start: int, done: Callable[[str], bool], timeout: float = 60) -> str:
    """The cluster log written since byte ``start`` once ``done`` holds for it (polled: the
    log is written by other processes); fails after ``timeout`` seconds with what it has."""
    deadline = time.monotonic() + timeout
    while True:
        text = log.read_bytes()[start:].decode(errors="replace")
        if done(text) or time.monotonic() > deadline:
            assert done(text), f"not in the log after {timeout:.0f} s:\n{text[-3000:]}"
            return text
        time.sleep(0.2)


@contextmanager
def local_cluster(
    count: int,
    weights: list[float] | None = None,
    model: str = "smollm2-135m",
    extra: tuple[str, ...] = (),
    ready: bool = True,
    bench: bool = False,
    env: dict[str, str] | None = None,
    log: Path | None = None,
    headers: dict[str, str] | None = None,
    fd_limit: tuple[int, int] | None = None,
) -> Iterator[LocalCluster]:
    """``exo-tp run --local-nodes``. ``fd_limit``: the nodes' open-files limit (soft, hard),
    as on a machine with a low one. Without weights, --profile or ``bench`` the nodes get
    --no-bench: a test spends ~10 s of CPU on a device measurement only if it asks for one.
    ``env``: variables added to this process's; ``log``: the cluster's stderr goes there;
    ``headers``: sent with the readiness checks (an API key)."""
    base = free_port_base(count)
    # A generous stall timeout: a loaded 2-core box can take long over a batched step; the
    # stall tests set their own.
    stall = () if "--stall-timeout" in extra else ("--stall-timeout", "300")
    # Unpinned ranks on a shared 2-core box: a test asks for live rebalancing explicitly.
    stall += () if "--rebalance" in extra else ("--rebalance", "off")
    args = [
        *CLI,
        "run",
        "--local-nodes",
        str(count),
        "--api-port",
        str(base),
        "--model",
        model,
        *stall,
        *extra,
    ]
    if weights:
        args += ["--weights", ",".join(map(str, weights))]
    elif "--profile" not in extra and not bench:
        args.append("--no-bench")
    # Without a log asked for, one all the same (deleted afterwards): a cluster that never
    # gets ready shows its end in the error.
    own_log = None
    if log is None:
        handle, name = tempfile.mkstemp(prefix="exo-tp-cluster-", suffix=".log")
        os.close(handle)
        log = own_log = Path(name)
    stderr = log.open("w")
    proc = subprocess.Popen(
        args,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        start_new_session=True,
        env={**os.environ, **env} if env else None,
        preexec_fn=None if fd_limit is None else lambda: _limit_files(fd_limit),
    )
    urls = [f"http://127.0.0.1:{base + i}" for i in range(count)]
    try:
        if ready:
            wait_ready(urls, nodes=count, headers=headers, logs=[log])
        yield LocalCluster(urls, proc, log)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        stderr.close()
        if own_log is not None:
            own_log.unlink(missing_ok=True)


def _limit_files(limit: tuple[int, int]) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, limit)


@dataclass
class LoopbackNodes:
    urls: list[str]
    cluster: str
    secret: str
    logs: list[Path]  # node i's stderr


@contextmanager
def loopback_nodes(
    node_args: list[list[str]],
    model: str | None,
    logs: Path,
    ready: bool = True,
    env: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
    node_env: list[dict[str, str]] | None = None,
) -> Iterator[LoopbackNodes]:
    """One node per entry of ``node_args`` (its own `exo-tp run` flags) on 127.0.0.1, in one
    fresh cluster, started by the `LocalCluster` the CLI uses (`SupervisedNodes` here): node
    ids n0, n1, ...; each node's stderr in ``logs``/n<i>.log. The secret reaches them in
    $EXO_TP_SECRET; ``env`` adds to (or overrides) their environment; ``headers`` go with the
    readiness checks (an API key). ``model`` None: only the nodes whose own arguments name one
    get a --model; ``node_env``: each node's own variables."""
    count = len(node_args)
    base = free_port_base(count)
    cluster, secret = f"test-{secrets.token_hex(4)}", secrets.token_hex(16)
    urls = [f"http://127.0.0.1:{base + i}" for i in range(count)]
    node_logs = [logs / f"n{i}.log" for i in range(count)]
    with SupervisedNodes() as nodes:
        for i, extra in enumerate(node_args):
            flags = ["--host", "127.0.0.1", "--api-port", str(base + i), "--node-id", f"n{i}"]
            flags += ["--cluster", cluster, *(["--model", model] if model else [])]
            # a test asks for live rebalancing explicitly (see local_cluster)
            flags += [*(() if "--rebalance" in extra else ("--rebalance", "off")), *extra]
            own = node_env[i] if node_env else {}
            variables = {"EXO_TP_SECRET": secret, **(env or {}), **own}
            nodes.start(node_job(i, options_from_flags(flags), variables, node_logs[i]))
        if ready:
            wait_ready(urls, nodes=count, headers=headers, logs=node_logs)
        yield LoopbackNodes(urls, cluster, secret, node_logs)


def can_make_namespaces() -> str | None:
    """None if this process may create network namespaces, else why not."""
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@dataclass
class Host:
    name: str  # network namespace
    ip: str
    proc: subprocess.Popen | None = None
    log: Path | None = None

    @property
    def url(self) -> str:
        return f"http://{self.ip}:8000"


def _tc(*args: str) -> None:
    subprocess.run(["tc", *args], check=True, capture_output=True)


def _has_htb(dev: str) -> bool:
    shown = subprocess.run(["tc", "qdisc", "show", "dev", dev], capture_output=True, text=True)
    return "htb 1:" in shown.stdout


@dataclass
class NamespaceLab:
    """A bridge on this machine and hosts in their own network namespaces behind it."""

    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    subnet: str = field(
        default_factory=lambda: f"10.{100 + secrets.randbelow(100)}.{secrets.randbelow(250)}"
    )
    hosts: list[Host] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"etpbr{self.tag}"

    def up(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        _ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)

    def add_host(self) -> Host:
        index = len(self.hosts) + 1
        name, veth = f"etp{self.tag}n{index}", f"etp{self.tag}v{index}"
        ip = f"{self.subnet}.{10 + index}"
        _ip("netns", "add", name)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
        _ip("link", "set", veth, "master", self.bridge, "up")
        _ip("-n", name, "addr", "add", f"{ip}/24", "dev", "eth0")
        _ip("-n", name, "link", "set", "eth0", "up")
        _ip("-n", name, "link", "set", "lo", "up")
        host = Host(name, ip)
        self.hosts.append(host)
        return host

    def veth(self, host: Host) -> str:
        """The bridge's end of ``host``'s link."""
        return f"etp{self.tag}v{self.hosts.index(host) + 1}"

    def throttle(self, a: Host, b: Host, rate: str) -> None:
        """Only the traffic between ``a`` and ``b`` at ``rate`` (tc's units: "8mbit"), each way;
        every other pair stays at the bridge's speed (an HTB class per direction, chosen by
        the sender's address, on the veth that delivers to the receiver)."""
        for sender, receiver in ((a, b), (b, a)):
            dev = self.veth(receiver)
            if not _has_htb(dev):
                _tc("qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
                _tc("class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb",
                    "rate", "10gbit")  # fmt: skip
            _tc("class", "add", "dev", dev, "parent", "1:", "classid", "1:20", "htb",
                "rate", rate)  # fmt: skip
            _tc("filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
                "u32", "match", "ip", "src", f"{sender.ip}/32", "flowid", "1:20")  # fmt: skip

    def start_node(
        self, host: Host, tmp: Path, *args: str, env: dict[str, str] | None = None
    ) -> None:
        """``exo-tp run`` on ``host``; ``env`` adds to its environment (the secret goes there:
        never on a command line).

        Each node has one rank, so it would let its rank spin while waiting in a collective
        (what a machine of its own does best); the lab's "machines" share this box's cores,
        where a spinning rank takes the core its peer needs: ranks sleep-wait instead
        (EXO_TP_RING_WAIT=sleep: 24 tokens of the tiny model on 3 nodes 11-12 s -> 1.3-1.8 s)."""
        host.log = tmp / f"{host.name}.log"
        host.proc = subprocess.Popen(
            ["ip", "netns", "exec", host.name, *CLI, "run", "--host", host.ip, *args],
            stdout=host.log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, WAIT_ENV: "sleep", **(env or {})},
        )

    def stop_node(self, host: Host) -> None:
        if host.proc is not None and host.proc.poll() is None:
            os.killpg(host.proc.pid, signal.SIGTERM)
            try:
                host.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(host.proc.pid, signal.SIGKILL)
                host.proc.wait()

    def down(self) -> None:
        for host in self.hosts:
            self.stop_node(host)
            # anything still running inside the namespace (a worker) goes too
            pids = subprocess.run(
                ["ip", "netns", "pids", host.name], capture_output=True, text=True
            ).stdout.split()
            for pid in pids:
                with suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def worker_pids(namespace: str) -> list[int]:
    pids = subprocess.run(
        ["ip", "netns", "pids", namespace], capture_output=True, text=True
    ).stdout.split()
    return [
        int(p) for p in pids if b"exo_tp.runtime.rank" in Path(f"/proc/{p}/cmdline").read_bytes()
    ]


def rank_processes(root_pid: int) -> dict[str, psutil.Process]:
    """Node id -> rank process, for every rank below ``root_pid``."""
    out = {}
    for proc in psutil.Process(root_pid).children(recursive=True):
        cmdline = proc.cmdline()
        if "exo_tp.runtime.rank" in cmdline:
            job = json.loads(Path(cmdline[cmdline.index("exo_tp.runtime.rank") + 1]).read_text())
            out[job["nodes"][job["rank"]]] = proc
    return out


@dataclass
class LongStream:
    """A long greedy chat streamed from ``url`` in a thread: ``streaming`` is set at its first
    chunk; the API error that ends it, if any, lands in ``errors``; ``stop()`` hangs up (the
    client leaves, as a user closing the tab does) instead of waiting for 2000 tokens."""

    url: str
    model: str
    content: str = "Tell a long story."  # the user's message
    errors: list[str] = field(default_factory=list)
    streaming: threading.Event = field(default_factory=threading.Event)
    stopping: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> LongStream:
        self.thread = threading.Thread(target=self._stream)
        self.thread.start()
        assert self.streaming.wait(300), "the stream never started"
        return self

    def _stream(self) -> None:
        api = OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)
        try:
            chunks = api.chat.completions.create(
                model=self.model,
                messages=[{"role": "user", "content": self.content}],
                temperature=0,
                max_tokens=2000,
                stream=True,
            )
            with chunks:  # closes the connection when the loop is left early
                for _ in chunks:
                    self.streaming.set()
                    if self.stopping.is_set():
                        return
        except APIError as error:
            self.errors.append(str(error))

    def stop(self, timeout: float = 60) -> None:
        """Hang up at the next chunk and wait for the thread."""
        self.stopping.set()
        self.ended(timeout)

    def ended(self, timeout: float = 60) -> list[str]:
        """Wait for the stream to end; its errors."""
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream did not end"
        return self.errors
