"""Measure this node's links to its peers with the MLX collectives the engine uses.

First the peers meet (`rendezvous`): peers absent after ``timeout`` seconds are reported down
at once. Then the pairs of the round-robin schedule (`peers`) are measured one round at a time,
each by a 2-rank ring child process (`link_probe`) on the pair's private ports, started by the
one supervisor (`exo_tp.process.supervisor`) and stopped at ``timeout`` seconds: a link that
does not answer is reported down, the bench never hangs.
"""

from __future__ import annotations

import queue
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from exo_tp.frozen import Frozen
from exo_tp.process.events import Exited, Failed, Finished, ProcessEvent
from exo_tp.process.supervisor import Child, Job, Supervisor, clean_environment
from exo_tp.profile.link_probe import PROBE_EVENTS, LinkMeasurement, Measured
from exo_tp.profile.peers import Peers
from exo_tp.profile.progress import Progress
from exo_tp.profile.rendezvous import meet_peers
from exo_tp.transport.ring import ring_env, write_hostfile
from exo_tp.wire.profiles import LinkProfile, measured_now


class ProbeFailure(Frozen):
    message: str
    timed_out: bool = False  # no result by the deadline (rather than a failed probe)


def probe_job(
    name: str,
    rank: int,
    hostfile: Path,
    quick: bool,
    prefix: Sequence[str] = (),
    base_env: Mapping[str, str] | None = None,
    cores: tuple[int, ...] | None = None,
) -> Job:
    """One end of a pair's probe; ``prefix``: a command it runs under (a bench's cgroup);
    ``base_env``: the environment it starts from (default: `clean_environment`); ``cores``:
    the CPUs it is pinned to (the lab's one rank per core)."""
    base = clean_environment() if base_env is None else base_env
    env = {k: v for k, v in base.items() if not k.startswith("MLX_")}
    env.update(ring_env(rank, hostfile, env))
    argv = (*prefix, sys.executable, "-m", "exo_tp.profile.link_probe")
    argv = (*argv, *(["--quick"] if quick else []))
    return Job(name=name, argv=argv, env=env, cores=cores, stdout="null")


def measure_pair(jobs: Sequence[Job], timeout: float) -> list[LinkMeasurement | ProbeFailure]:
    """Run the probe ``jobs`` (the ends of one pair on this machine) side by side, each
    stopped at ``timeout`` seconds; what each measured, or why not."""
    events: queue.Queue[tuple[Child, ProcessEvent]] = queue.Queue()
    supervisor = Supervisor(lambda c, e: events.put((c, e)), PROBE_EVENTS, name="link probe")
    try:
        children = [supervisor.start(job) for job in jobs]
        outcome: dict[str, LinkMeasurement | ProbeFailure] = {}
        deadline = time.monotonic() + timeout
        while len(outcome) < len(children):
            try:
                child, event = events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if isinstance(event, Finished) and isinstance(event.message, Measured):
                outcome[child.token] = event.message.measurement
            elif isinstance(event, Failed) and child.token not in outcome:
                outcome[child.token] = ProbeFailure(
                    message=f"probe exited {child.process.returncode}: "
                    f"{child.reported or 'no report'}"
                )
            elif isinstance(event, Exited) and child.token not in outcome:
                outcome[child.token] = ProbeFailure(message="probe exited 0: no report")
        return [
            outcome.get(c.token)
            or ProbeFailure(message=f"no measurement within {timeout:g}s", timed_out=True)
            for c in children
        ]
    finally:
        supervisor.close()


def _probe(peers: Peers, partner: int, timeout: float, quick: bool, tmp: Path) -> LinkProfile:
    me, lo, hi = peers.rank, min(peers.rank, partner), max(peers.rank, partner)
    ports = peers.pair_ports(lo, hi)
    hostfile = tmp / f"pair-{lo}-{hi}.json"
    write_hostfile(
        hostfile, [f"{peers.addresses[r]}:{p}" for r, p in zip((lo, hi), ports, strict=True)]
    )
    a, b = peers.label(me), peers.label(partner)
    job = probe_job(f"link probe {a}-{b}", 0 if me == lo else 1, hostfile, quick)
    (measured,) = measure_pair([job], timeout)
    if isinstance(measured, LinkMeasurement):
        return LinkProfile(a=a, b=b, up=True, measured_at=measured_now(), **measured.model_dump())
    why = f" (peer gone, or ports {ports[0]}/{ports[1]} blocked)" if measured.timed_out else ""
    return LinkProfile(a=a, b=b, up=False, error=measured.message + why, measured_at=measured_now())


def measure_links(
    peers: Peers, timeout: float, quick: bool, progress: Progress | None = None
) -> tuple[LinkProfile, ...]:
    """This node's link to every other node, in schedule order."""
    progress = progress or Progress(enabled=False)
    partners = peers.partners()
    progress.expect(1 + len(partners))
    with progress.step("meeting peers"):
        met = meet_peers(peers, timeout)
    links = []
    with tempfile.TemporaryDirectory(prefix="exo-tp-links-") as tmp:
        for partner in partners:
            with progress.step(f"link to {peers.label(partner)}"):
                if met[partner] is not None:
                    links.append(
                        LinkProfile(
                            a=peers.label(peers.rank),
                            b=peers.label(partner),
                            up=False,
                            error=met[partner],
                        )
                    )
                else:
                    links.append(_probe(peers, partner, timeout, quick, Path(tmp)))
    return tuple(links)
