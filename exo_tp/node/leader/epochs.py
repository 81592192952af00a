"""Epoch numbers for every group this node leads: each new epoch, whichever group forms it, is
higher than any this node or a peer has seen, so that a node's assignments never go back and
two groups forming at once never share a number."""

from __future__ import annotations

from collections.abc import Callable

from exo_tp.wire.ids import Epoch


class EpochNumbers:
    def __init__(self, highest_seen: Callable[[], int]):
        self._highest_seen = highest_seen  # what this node was assigned, and its peers report
        self._last = 0

    def claim(self, at_least: int = 0) -> Epoch:
        """A new epoch number, above every one seen or claimed and above ``at_least``."""
        self._last = max(self._last, self._highest_seen(), at_least) + 1
        return Epoch(self._last)
