"""Ports for ring jobs: free, distinct, and out of the range the kernel gives connecting
sockets (a port from that range, probed free, could be taken by any connection on the machine
before the job's rank binds it)."""

from __future__ import annotations

import random
import socket

from exo_tp.transport.ports import LOWEST, ephemeral_low, free_ports


def test_ports_are_free_distinct_and_below_the_ephemeral_range() -> None:
    ports = free_ports(16)
    assert len(set(ports)) == 16
    assert all(LOWEST <= p < ephemeral_low() for p in ports), ports
    held = []
    try:
        for port in ports:  # each binds now, as a rank will
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.bind(("127.0.0.1", port))
    finally:
        for s in held:
            s.close()


def test_a_seeded_random_module_does_not_repeat_the_draw() -> None:
    random.seed(0)
    first = free_ports(4)
    random.seed(0)
    assert free_ports(4) != first


def test_a_taken_port_is_never_returned() -> None:
    held = []
    try:
        for port in free_ports(64):  # hold many; the next draws must avoid every one
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", port))
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        assert not taken & set(free_ports(64))
    finally:
        for s in held:
            s.close()
