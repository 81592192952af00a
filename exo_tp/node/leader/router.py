"""Which replica runs a request: the least loaded, but a conversation goes back to the replica
whose prompt cache holds its prefix (its next turn starts with the last turn's prompt), unless
that replica is much busier than another. Only replicas that serve now are candidates, so a
replica that died or re-plans is routed around.

`choose` is pure; `Router` keeps each replica's recent prompts (their first tokens) for it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from exo_tp.frozen import Frozen

PREFIX_TOKENS = 4096  # the first tokens of a prompt kept to match the next turn against
RECENT_PROMPTS = 64  # prompts kept per replica
MIN_SHARED = 32  # tokens in common that make a conversation's replica worth going back to


class Candidate(Frozen):
    group: str
    load: int  # requests running and waiting on it
    capacity: int  # requests it runs at once (its batch)
    shared: int = 0  # tokens its prompt cache likely holds of this prompt


def choose(candidates: Sequence[Candidate]) -> Candidate:
    """The replica for a request: the one sharing the longest prefix with it (at least
    MIN_SHARED tokens) unless it is more than a quarter of a batch busier than the least
    loaded; else the least loaded (ties: the first)."""
    least = min(candidates, key=lambda c: c.load)
    slack = max(1, least.capacity // 4)
    warm = [c for c in candidates if c.shared >= MIN_SHARED and c.load <= least.load + slack]
    if warm:
        return max(warm, key=lambda c: (c.shared, -c.load))
    return least


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Router:
    def __init__(self) -> None:
        self._recent: dict[str, deque[tuple[int, ...]]] = {}

    def shared(self, group: str, tokens: Sequence[int]) -> int:
        """The longest prefix ``tokens`` shares with a prompt ``group`` ran lately."""
        recent = self._recent.get(group, ())
        return max((shared_prefix(p, tokens) for p in recent), default=0)

    def ran(self, group: str, tokens: Sequence[int]) -> None:
        recent = self._recent.setdefault(group, deque(maxlen=RECENT_PROMPTS))
        recent.append(tuple(tokens[:PREFIX_TOKENS]))

    def forget(self, group: str) -> None:
        """A replica that re-formed lost its cache."""
        self._recent.pop(group, None)
