"""The link schedule every node derives on its own must agree (pure)."""

from __future__ import annotations

import itertools

import pytest
from pydantic import ValidationError

from exo_tp.profile.peers import Peers, pair_index, round_robin


@pytest.mark.parametrize("n", range(2, 10))
def test_round_robin_meets_every_pair_once(n: int) -> None:
    rounds = round_robin(n)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == list(itertools.combinations(range(n), 2))
    for r in rounds:  # a node measures at most one link at a time
        nodes = [x for p in r for x in p]
        assert len(nodes) == len(set(nodes))
    assert len(rounds) == n - 1 + n % 2


@pytest.mark.parametrize("n", range(2, 10))
def test_ports_are_private_and_agreed(n: int) -> None:
    nodes = [Peers(addresses=("127.0.0.1",) * n, rank=r, port_base=40000) for r in range(n)]
    assert [pair_index(n, a, b) for a, b in itertools.combinations(range(n), 2)] == list(
        range(n * (n - 1) // 2)
    )
    ports = [nodes[0].hello_port(r) for r in range(n)] + [
        p for a, b in itertools.combinations(range(n), 2) for p in nodes[0].pair_ports(a, b)
    ]
    assert sorted(ports) == list(range(40000, 40000 + n * n))
    for a, b in itertools.combinations(range(n), 2):  # both ends compute the same ports
        assert nodes[a].pair_ports(a, b) == nodes[b].pair_ports(b, a)
    for node in nodes:  # partners follow the shared schedule
        expected = [
            b if a == node.rank else a for r in round_robin(n) for a, b in r if node.rank in (a, b)
        ]
        assert node.partners() == expected and sorted(expected) == [
            r for r in range(n) if r != node.rank
        ]


def test_bad_peer_settings_are_refused() -> None:
    with pytest.raises(ValidationError, match="rank 2"):
        Peers(addresses=("a", "b"), rank=2)
    with pytest.raises(ValidationError, match="exceed 65535"):
        Peers(addresses=("a", "b", "c"), rank=0, port_base=65530)
    assert (
        Peers(addresses=("a", "b"), rank=0).fingerprint()
        != Peers(addresses=("a", "c"), rank=0).fingerprint()
    )
