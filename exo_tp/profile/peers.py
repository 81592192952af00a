"""Who measures which link when (pure): every node of a bench runs the same schedule.

Every node runs ``exo-tp bench --peers a0,a1,...,an-1 --rank i --port-base P``. Pairs are
measured one round at a time in a round-robin tournament (circle method): in each round a node
measures at most one link, so measurements never share a node's CPU or NIC. Each pair gets its
own two ports, so a late or killed pair can never mix its traffic into another (ring sockets use
SO_REUSEPORT). Ports used: ``P .. P + n*n - 1`` (n rendezvous ports, then 2 per pair).
"""

from __future__ import annotations

import hashlib
import json

from pydantic import Field, model_validator

from exo_tp.plan.spec import Frozen

DEFAULT_PORT_BASE = 52100


def round_robin(n: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint pairs (lower rank first) covering every pair of ``n`` nodes once."""
    m = n + n % 2  # an odd count gets a dummy: its partner sits the round out
    order = list(range(m))
    rounds = []
    for _ in range(m - 1):
        pairs = [tuple(sorted((order[i], order[m - 1 - i]))) for i in range(m // 2)]
        rounds.append([(a, b) for a, b in pairs if b < n])
        order = [order[0], order[-1], *order[1:-1]]  # rotate all but the first
    return rounds


def pair_index(n: int, a: int, b: int) -> int:
    """Position of the pair {a, b} in the lexicographic list of all pairs of ``n`` nodes."""
    lo, hi = min(a, b), max(a, b)
    return lo * (2 * n - lo - 1) // 2 + (hi - lo - 1)


class Peers(Frozen):
    addresses: tuple[str, ...] = Field(min_length=2)  # one per node; index = rank
    rank: int = Field(ge=0)
    port_base: int = Field(default=DEFAULT_PORT_BASE, ge=1, le=65535)

    @model_validator(mode="after")
    def _fits(self) -> Peers:
        if self.rank >= self.size:
            raise ValueError(f"rank {self.rank} is not below the {self.size} peers")
        if self.port_base + self.size**2 - 1 > 65535:
            raise ValueError(
                f"ports {self.port_base}..{self.port_base + self.size**2 - 1} exceed 65535"
            )
        return self

    @property
    def size(self) -> int:
        return len(self.addresses)

    def label(self, rank: int) -> str:
        return f"{rank}@{self.addresses[rank]}"

    def hello_port(self, rank: int) -> int:
        return self.port_base + rank

    def pair_ports(self, a: int, b: int) -> tuple[int, int]:
        """Ports the lower and the higher rank of pair {a, b} listen on."""
        first = self.port_base + self.size + 2 * pair_index(self.size, a, b)
        return first, first + 1

    def partners(self) -> list[int]:
        """This node's partner in each round it plays, in schedule order."""
        return [
            b if a == self.rank else a
            for pairs in round_robin(self.size)
            for a, b in pairs
            if self.rank in (a, b)
        ]

    def fingerprint(self) -> str:
        """Equal on nodes started with the same peers and ports (a mismatch is reported)."""
        text = json.dumps([self.addresses, self.port_base])
        return hashlib.sha256(text.encode()).hexdigest()[:16]
