"""Links measured by real bench processes on loopback; absent or silent peers are reported down
in bounded time instead of hanging."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import CLI, assert_latency_in_seconds, tcp_loopback_reference

from exo_tp.plan.devices import DeviceProfile
from exo_tp.profile.cache import save
from exo_tp.profile.peers import Peers
from exo_tp.profile.rendezvous import BENCH_KEY, HELLO, BenchHello
from exo_tp.profile.system import SystemInfo
from exo_tp.transport.channel import Channel, Listener
from exo_tp.transport.ports import free_ports
from exo_tp.wire.profiles import LinkProfile

pytestmark = pytest.mark.alone  # under pytest-xdist: it measures links between bench processes

# The benches multiply with MLX's bundled BLAS: `exo-tp` then starts without re-executing
# itself to preload OpenBLAS, a start-up that the timing bounds below would also count.
BENCH_ENV = {"EXO_TP_BLAS": "bundled"}


@functools.cache
def _bench_system() -> SystemInfo:
    """This device as an `exo-tp bench` process started with BENCH_ENV sees it."""
    code = "from exo_tp.profile.system import system_info; print(system_info().model_dump_json())"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **BENCH_ENV},
        capture_output=True,
        text=True,
        check=True,
    )
    return SystemInfo.model_validate_json(done.stdout)


def _seed_cache(home: Path) -> None:
    """A cached profile for this device, so the bench only measures links (fast)."""
    info = _bench_system()
    save(
        DeviceProfile(
            **info.model_dump(),
            memory_bandwidth=1e9,
            decode_seconds_per_byte=1e-9,
            prefill_flops=1e9,
            layer_overhead_seconds=3e-4,
            quick=True,
        ),
        home / "profile.json",
    )


def _start_bench(
    home: Path, peers: str, rank: int, port_base: int, *extra: str
) -> subprocess.Popen[str]:
    _seed_cache(home)
    return subprocess.Popen(
        [
            *CLI,
            "bench",
            "--quick",
            "--json",
            "--peers",
            peers,
            "--rank",
            str(rank),
            "--port-base",
            str(port_base),
            *extra,
        ],
        env={**os.environ, **BENCH_ENV, "EXO_TP_HOME": str(home)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _links(proc: subprocess.Popen[str], timeout: float = 60) -> list[LinkProfile]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err
    return list(DeviceProfile.model_validate_json(out.strip().splitlines()[-1]).links)


def _port_base(count: int) -> int:
    """A run of ``count`` consecutive ports that are free right now."""
    while True:
        base = free_ports(1)[0]
        if base + count < 65536 and all(_free(p) for p in range(base, base + count)):
            return base


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_two_bench_processes_measure_their_link(tmp_path: Path) -> None:
    base = _port_base(4)
    procs = [_start_bench(tmp_path / f"n{r}", "127.0.0.1,127.0.0.1", r, base) for r in (0, 1)]
    seen = [_links(p) for p in procs]
    one_way, rate = tcp_loopback_reference()
    for rank, links in enumerate(seen):
        assert len(links) == 1
        link = links[0]
        assert link.up, link.error
        assert (link.a, link.b) == (f"{rank}@127.0.0.1", f"{1 - rank}@127.0.0.1")
        assert link.all_sum_latency and link.send_recv_latency and link.all_sum_bandwidth
        assert_latency_in_seconds(link.send_recv_latency, one_way)
        assert rate / 100 < link.all_sum_bandwidth < rate * 4, (link, rate)
        # What an all_sum adds to a decode step: measured, in seconds (not ms or µs).
        assert link.all_sum_in_graph is not None and 0 <= link.all_sum_in_graph < 0.05, link


def test_absent_peer_is_down_within_the_timeout_and_others_still_measure(tmp_path: Path) -> None:
    """Three nodes, rank 2 never starts: 0-1 is measured, links to 2 are down after ~6 s."""
    base = _port_base(9)
    start = time.monotonic()
    procs = [
        _start_bench(
            tmp_path / f"n{r}", "127.0.0.1,127.0.0.1,127.0.0.1", r, base, "--link-timeout", "6"
        )
        for r in (0, 1)
    ]
    seen = [_links(p) for p in procs]
    elapsed = time.monotonic() - start
    for rank, links in enumerate(seen):
        by_peer = {x.b: x for x in links}
        assert by_peer[f"{1 - rank}@127.0.0.1"].up
        down = by_peer["2@127.0.0.1"]
        assert not down.up and "unreachable within 6s" in (down.error or "")
    # 6 s of waiting for rank 2, plus start-up and one ~1 s link measurement.
    assert 6 <= elapsed < 14, elapsed


def test_peer_that_never_measures_is_down_at_the_deadline(tmp_path: Path) -> None:
    """A peer answers the rendezvous but never joins the ring: the probe is killed in time."""
    base = _port_base(4)
    peers = Peers(addresses=("127.0.0.1", "127.0.0.1"), rank=1, port_base=base)

    def answer_once(channel: Channel[BenchHello]) -> None:
        with contextlib.closing(channel):
            if channel.poll(20) and channel.recv() is not None:
                channel.send(BenchHello(rank=1, fingerprint=peers.fingerprint()))

    # The real rendezvous protocol, answered by a peer that then never measures.
    server = Listener(
        f"127.0.0.1:{peers.hello_port(1)}", BENCH_KEY, HELLO, answer_once, "silent peer"
    )
    start = time.monotonic()
    proc = _start_bench(tmp_path, "127.0.0.1,127.0.0.1", 0, base, "--link-timeout", "3")
    links = _links(proc)
    elapsed = time.monotonic() - start
    server.close()
    assert len(links) == 1 and not links[0].up
    assert "no measurement within 3s" in (links[0].error or ""), links[0].error
    assert elapsed < 3 + 5, elapsed


def test_peer_options_are_checked() -> None:
    for args, message in [
        (["--peers", "10.0.0.1"], "two or more"),
        (["--peers", "10.0.0.1,10.0.0.2"], "--peers needs --rank"),
        (["--rank", "0"], "--rank needs --peers"),
        (["--peers", "10.0.0.1,10.0.0.2", "--rank", "2"], "rank 2 is not below the 2 peers"),
        (["--peers", "a,b,c", "--rank", "0", "--port-base", "65530"], "exceed 65535"),
        (["--peers", "a,b", "--rank", "0", "--link-timeout", "0"], "more than 0"),
    ]:
        result = subprocess.run([*CLI, "bench", *args], capture_output=True, text=True, timeout=60)
        assert result.returncode != 0
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (args, result.stderr)
        assert lines[0].startswith("exo-tp: error:")
