"""Joining an MLX `ring` group started by exo-tp (hostfile + rank in the environment)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import mlx.core as mx

from exo_tp.transport.ring_wait import sleeping_waits


def write_hostfile(path: Path, addresses: Sequence[str]) -> None:
    """MLX's per-rank hostfile: one list of "ip:port" a rank listens on, per rank."""
    path.write_text(json.dumps([[address] for address in addresses]))


def ring_env(rank: int, hostfile: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of ring rank ``rank`` started with ``base`` (default: this process's
    environment): its place in the ring, and waits that sleep rather than spin
    (`exo_tp.transport.ring_wait`)."""
    hosts = [entry[0].rsplit(":", 1)[0] for entry in json.loads(hostfile.read_text())]
    sharing = hosts.count(hosts[rank])  # the ranks on this rank's host share its cores
    return {
        "MLX_RANK": str(rank),
        "MLX_HOSTFILE": str(hostfile),
        **sleeping_waits(base, sharing),
    }


def jaccl_env(rank: int, coordinator: str, devices_file: Path) -> dict[str, str]:
    return {
        "MLX_RANK": str(rank),
        "MLX_JACCL_COORDINATOR": coordinator,
        "MLX_IBV_DEVICES": str(devices_file),
    }


def init_group() -> mx.distributed.Group:
    """The group the environment describes: jaccl (RDMA) if set up, else the ring."""
    if "MLX_IBV_DEVICES" in os.environ:
        return mx.distributed.init(backend="jaccl", strict=True)
    return init_ring()


def init_ring() -> mx.distributed.Group:
    """The ring group described by MLX_RANK/MLX_HOSTFILE (strict: never a silent group of 1)."""
    if "MLX_HOSTFILE" not in os.environ:
        return mx.distributed.init()  # a single rank
    return mx.distributed.init(backend="ring", strict=True)


def barrier(group: mx.distributed.Group) -> None:
    """Let in-flight communication finish before a rank exits (else peers see a lost link)."""
    mx.synchronize()
    if group.size() > 1:
        mx.eval(mx.distributed.all_sum(mx.ones(1), group=group))


def leave(group: mx.distributed.Group) -> None:
    """A normal end of the group: meet at a barrier, stop reporting on stderr, and meet again
    before leaving. The group's ranks exit a few milliseconds apart, and MLX's ring logs each
    peer that closed its socket first (from its own threads): noise at the end of a finished
    job, not news. With only the first barrier, 2 of 6 three-rank launches still printed a dozen
    such lines after a correct answer; with the second, which no rank passes before every rank
    has silenced itself, none of 12 did (tests/ranks/test_launch_cli.py)."""
    try:
        barrier(group)
    except RuntimeError:  # a peer is already gone: nothing left to wait for
        return
    if group.size() > 1:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
        with contextlib.suppress(RuntimeError):  # silenced: a peer gone now changes nothing
            barrier(group)
