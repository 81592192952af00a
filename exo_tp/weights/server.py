"""The routes a node serves weights on: an aiohttp sub-application, signed with the cluster
secret, to mount on the node's control server (``control.add_subapp("/weights", ...)``).

A node serves each model it has: from the model folder ("files": reads at the tensors' data
offsets, only the requested pieces) and from its shard store ("memory": only boxes the store
holds, never its holes). Bodies are streamed in chunks, each read off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from aiohttp import web

from exo_tp.frozen import Frozen
from exo_tp.weights.boxes import Boxes
from exo_tp.weights.manifest import ModelManifest
from exo_tp.weights.pieces import iter_piece, piece_bytes
from exo_tp.weights.store import ShardStore
from exo_tp.weights.transfer import Holding
from exo_tp.wire.errors import PeerRefused
from exo_tp.wire.http import Route, Stream, post, signed_app
from exo_tp.wire.ids import ModelIdentity, NodeId
from exo_tp.wire.weights import FileRequest, ModelRequest, ReadRequest, ServedStats

log = logging.getLogger(__name__)

MOUNT = "/weights"  # where the node mounts the sub-application (clients use it)


class ServedModel:
    """A model this node can serve: its files, its shard store, or both."""

    def __init__(
        self, manifest: ModelManifest, folder: Path | None = None, store: ShardStore | None = None
    ):
        self.manifest = manifest
        self.folder = Path(folder) if folder is not None else None
        self.store = store

    def holding(self, node: NodeId) -> Holding:
        if self.folder is not None:
            return Holding(node=node, files=True, extras=True)
        if self.store is not None:
            return self.store.holding(node)
        return Holding(node=node)


class ServeOptions(Frozen):
    chunk_bytes: int = 1 << 20
    # For tests of the receiver: flip one byte in each of the first N chunks /read sends, and
    # pause after every chunk (a slow peer, to be killed mid-transfer).
    corrupt_chunks: int = 0
    chunk_delay_s: float = 0.0


class WeightServer:
    def __init__(self, node: NodeId, secret: str, options: ServeOptions | None = None):
        self.node = node
        self.secret = secret
        self.options = options or ServeOptions()
        self.models: dict[ModelIdentity, ServedModel] = {}
        self._by_source: dict[str, int] = defaultdict(int)
        self._by_requester: dict[NodeId, int] = defaultdict(int)
        self._file_bytes = 0
        self._corrupt_left = self.options.corrupt_chunks
        self._corrupted = 0

    def serve(self, model: ServedModel) -> None:
        self.models[model.manifest.identity] = model

    def configure(self, options: ServeOptions) -> None:
        self.options = options
        self._corrupt_left = options.corrupt_chunks

    def stats(self) -> ServedStats:
        return ServedStats(
            bytes_by_source=dict(self._by_source),
            bytes_by_requester=dict(self._by_requester),
            file_bytes=self._file_bytes,
            corrupted_chunks=self._corrupted,
        )

    def routes(self) -> list[Route]:
        return [
            # Signed like a request: the receiver checks every byte against its digests.
            post("/manifest", ModelRequest, self._manifest, sign_reply=True),
            post("/holdings", ModelRequest, self._holdings),
            post("/file", FileRequest, self._file),
            post("/read", ReadRequest, self._read),
        ]

    def app(self) -> web.Application:
        return signed_app(self.secret, self.routes())

    def _model(self, identity: ModelIdentity) -> ServedModel:
        model = self.models.get(identity)
        if model is None:
            raise PeerRefused(f"no model {identity[:12]} here", 404)
        return model

    async def _manifest(self, ask: ModelRequest) -> ModelManifest:
        return self._model(ask.model).manifest

    async def _holdings(self, ask: ModelRequest) -> Holding:
        model = self.models.get(ask.model)
        return model.holding(self.node) if model else Holding(node=self.node)

    async def _file(self, ask: FileRequest) -> bytes:
        model = self._model(ask.model)
        if ask.name not in {f.name for f in model.manifest.extra_files}:
            raise PeerRefused(f"{ask.name} is not a file of this model", 404)
        if model.folder is not None:
            data = await asyncio.to_thread((model.folder / ask.name).read_bytes)
        elif model.store is not None and model.store.has_file(ask.name):
            data = await asyncio.to_thread(model.store.read_file, ask.name)
        else:
            raise PeerRefused(f"{ask.name} is not here")
        self._file_bytes += len(data)
        return data

    def _pieces(self, model: ServedModel, ask: ReadRequest) -> list[Iterator[bytes]] | str:
        """An iterator per piece, or why the request cannot be served."""
        manifest, out = model.manifest, []
        if ask.source == "files" and model.folder is None:
            return "no model files here"
        if ask.source == "memory" and model.store is None:
            return "no shard store here"
        for p in ask.pieces:
            entry = manifest.by_name.get(p.tensor)
            if entry is None:
                return f"no tensor {p.tensor}"
            try:
                entry.blocks(p.start, p.stop)
            except ValueError as bad:
                return str(bad)
            if ask.source == "memory":
                assert model.store is not None
                if not model.store.held.covers(Boxes(ranges={p.tensor: ((p.start, p.stop),)})):
                    return f"{p.tensor}[{p.start}:{p.stop}] is not in this store"
                out.append(
                    model.store.read_piece(p.tensor, p.start, p.stop, self.options.chunk_bytes)
                )
            else:
                assert model.folder is not None
                out.append(
                    iter_piece(
                        model.folder / entry.file, entry, p.start, p.stop, self.options.chunk_bytes
                    )
                )
        return out

    async def _read(self, ask: ReadRequest) -> Stream:
        model = self._model(ask.model)
        pieces = self._pieces(model, ask)
        if isinstance(pieces, str):
            raise PeerRefused(pieces)
        manifest = model.manifest
        length = sum(piece_bytes(manifest.tensor(p.tensor), p.start, p.stop) for p in ask.pieces)
        return Stream(length, self._send(ask, pieces))

    async def _send(self, ask: ReadRequest, pieces: list[Iterator[bytes]]) -> AsyncIterator[bytes]:
        for chunks in pieces:
            while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
                if self._corrupt_left > 0:
                    self._corrupt_left -= 1
                    self._corrupted += 1
                    flipped = bytearray(chunk)
                    flipped[len(flipped) // 2] ^= 0xFF
                    chunk = bytes(flipped)
                    log.warning("corrupting a chunk for %s (test option)", ask.requester)
                yield chunk
                self._by_source[ask.source] += len(chunk)
                self._by_requester[ask.requester] += len(chunk)
                if self.options.chunk_delay_s:
                    await asyncio.sleep(self.options.chunk_delay_s)
