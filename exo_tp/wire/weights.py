"""The weight transport's messages: the bodies of its requests (exo_tp.weights.server/client; a
refusal is exo_tp.wire.errors.WireError), and what a node reports of its transfers (progress
of a fetch, bytes served) in its status.

Every request is a signed POST (exo_tp.wire.http: an HMAC of time, path and body).
``/read`` answers application/octet-stream: each requested piece's C-order bytes (see
exo_tp.weights.pieces), back to back in request order, streamed in chunks. ``/file`` answers a
file's bytes, ``/manifest`` a ModelManifest (signed like a request, so a receiver trusts the
digests it verifies against), ``/holdings`` a Holding.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from exo_tp.frozen import Frozen
from exo_tp.wire.ids import ModelIdentity, NodeId

MAX_PIECES = 100_000

SourceKind = Literal["memory", "files"]  # a peer's shard store, or its model folder


class Piece(Frozen):
    tensor: str
    start: int = Field(ge=0)
    stop: int = Field(ge=0)


class ReadRequest(Frozen):
    model: ModelIdentity
    source: SourceKind  # from the model files, or from the shard store
    requester: NodeId = NodeId("")  # the fetching node (accounting only)
    pieces: tuple[Piece, ...] = Field(min_length=1, max_length=MAX_PIECES)


class FileRequest(Frozen):
    model: ModelIdentity
    name: str
    requester: NodeId = NodeId("")


class ModelRequest(Frozen):
    """For /manifest and /holdings."""

    model: ModelIdentity


class TransferProgress(Frozen):
    node: NodeId
    model: ModelIdentity
    bytes_done: int  # verified and written
    bytes_total: int
    bytes_refetched: int  # received but fetched again (corrupt, or cut off)
    corrupt_pieces: int = 0  # pieces whose digests did not match (each fetched again)
    rate_bytes_s: float  # over the last few seconds
    eta_s: float | None
    failed_sources: tuple[str, ...]
    done: bool

    def line(self) -> str:
        """One log line: "B: 31.2 / 98.0 MB (32%), 45.1 MB/s, ETA 1.5 s"."""
        eta = (
            "done"
            if self.done
            else f"ETA {self.eta_s:.1f} s"
            if self.eta_s is not None
            else "ETA ?"
        )
        share = self.bytes_done / self.bytes_total if self.bytes_total else 1.0
        failed = f", failed: {', '.join(self.failed_sources)}" if self.failed_sources else ""
        return (
            f"{self.node}: {self.bytes_done / 1e6:.1f} / {self.bytes_total / 1e6:.1f} MB "
            f"({share:.0%}), {self.rate_bytes_s / 1e6:.1f} MB/s, {eta}{failed}"
        )


class ServedStats(Frozen):
    """Bytes this node sent: per source kind, per requesting node, and extra files."""

    bytes_by_source: dict[str, int]
    bytes_by_requester: dict[NodeId, int]
    file_bytes: int
    corrupted_chunks: int
