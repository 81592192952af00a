"""The one error model every node-to-node route answers with, and the exception behind it."""

from __future__ import annotations

from exo_tp.frozen import Frozen


class WireError(Frozen):
    """The body of every refusal (any status but 200) on a signed route."""

    error: str


class PeerRefused(Exception):
    """A peer answered a signed request with an error; or, raised by a route handler, the
    refusal to send (409 unless told: a stale epoch, pieces it does not hold)."""

    def __init__(self, error: str, status: int = 409):
        super().__init__(error)
        self.error, self.status = error, status


class UnsignedReply(Exception):
    """A reply that had to be signed with the cluster secret (a manifest) was not."""
