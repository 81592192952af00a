"""Typed bodies of the weight transport's requests (exo_tp.weights.server/client; a refusal is
exo_tp.wire.errors.WireError).

Every request is a signed POST (exo_tp.security.signing.control_headers over its path and body).
``/read`` answers application/octet-stream: each requested piece's C-order bytes (see
exo_tp.weights.pieces), back to back in request order, streamed in chunks. ``/file`` answers a
file's bytes, ``/manifest`` a ModelManifest (signed like a request, so a receiver trusts the
digests it verifies against), ``/holdings`` a Holding.
"""

from __future__ import annotations

from pydantic import Field

from exo_tp.frozen import Frozen
from exo_tp.weights.transfer import SourceKind

MAX_PIECES = 100_000


class Piece(Frozen):
    tensor: str
    start: int = Field(ge=0)
    stop: int = Field(ge=0)


class ReadRequest(Frozen):
    model: str  # the manifest's identity
    source: SourceKind  # from the model files, or from the shard store
    requester: str = ""  # the fetching node (accounting only)
    pieces: tuple[Piece, ...] = Field(min_length=1, max_length=MAX_PIECES)


class FileRequest(Frozen):
    model: str
    name: str
    requester: str = ""


class ModelRequest(Frozen):
    """For /manifest and /holdings."""

    model: str
