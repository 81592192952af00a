"""Measure this node's links to its peers with the MLX collectives the engine uses.

First the peers meet (`rendezvous`): peers absent after ``timeout`` seconds are reported down
at once. Then the pairs of the round-robin schedule (`peers`) are measured one round at a time,
each by a 2-rank ring child process (`link_probe`) on the pair's private ports, killed at
``timeout`` seconds: a link that does not answer is reported down, the bench never hangs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from exo_tp.plan.devices import LinkProfile
from exo_tp.profile.link_probe import LinkMeasurement
from exo_tp.profile.peers import Peers
from exo_tp.profile.progress import Progress
from exo_tp.profile.rendezvous import meet_peers
from exo_tp.transport.ring import ring_env, write_hostfile


def _probe(peers: Peers, partner: int, timeout: float, quick: bool, tmp: Path) -> LinkProfile:
    me, lo, hi = peers.rank, min(peers.rank, partner), max(peers.rank, partner)
    ports = peers.pair_ports(lo, hi)
    hostfile = tmp / f"pair-{lo}-{hi}.json"
    write_hostfile(
        hostfile, [f"{peers.addresses[r]}:{p}" for r, p in zip((lo, hi), ports, strict=True)]
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    env.update(ring_env(0 if me == lo else 1, hostfile))
    command = [sys.executable, "-m", "exo_tp.profile.link_probe", *(["--quick"] if quick else [])]
    link = {"a": peers.label(me), "b": peers.label(partner)}
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return LinkProfile(
            **link,
            up=False,
            error=f"no measurement within {timeout:g}s (peer gone, or ports "
            f"{ports[0]}/{ports[1]} blocked)",
        )
    if proc.returncode != 0 or not out.strip():
        last = (err.strip().splitlines() or ["no output"])[-1]
        return LinkProfile(**link, up=False, error=f"probe exited {proc.returncode}: {last}")
    measured = LinkMeasurement.model_validate_json(out.strip().splitlines()[-1])
    return LinkProfile(**link, up=True, **measured.model_dump())


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
