"""Fetch one node's share of a transfer plan from its peers into its shard store.

Pieces (whole digest blocks, a few MiB at most) are requested in batches from each planned
source, a few requests per source at a time, all sources at once. Each piece is checked
against the manifest's block digests and written in place (ShardStore.write_piece). A piece
whose digests do not match is fetched again from the next peer holding it; a peer that fails
(connection refused or dropped, killed, a read timeout, a server error) is dropped and all its
pieces go to the next peers holding them. Progress (bytes, rate, ETA) goes to a callback as a
TransferProgress.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import aiohttp

from exo_tp.frozen import Frozen
from exo_tp.weights.boxes import Boxes
from exo_tp.weights.manifest import ModelManifest
from exo_tp.weights.pieces import piece_bytes
from exo_tp.weights.store import ShardStore
from exo_tp.weights.transfer import Holding, NodeTransfer, Source, TransferError
from exo_tp.wire.errors import PeerRefused, UnsignedReply
from exo_tp.wire.http import SignedClient
from exo_tp.wire.ids import ModelIdentity, NodeId
from exo_tp.wire.weights import FileRequest, ModelRequest, Piece, ReadRequest, TransferProgress

log = logging.getLogger(__name__)

PIECE_BYTES = 4 << 20  # a piece is at most this (or one block if a block is bigger)
REQUEST_BYTES = 32 << 20  # pieces batched into one request
PER_SOURCE = 2  # concurrent requests per source
MAX_ATTEMPTS = 3  # of one piece, counting every source
RATE_WINDOW_S = 5.0
PROGRESS_EVERY_S = 0.25


class FetchReport(Frozen):
    node: NodeId
    model: ModelIdentity
    bytes_fetched: int  # verified and written into the store
    bytes_by_source: dict[NodeId, int]  # of those, from each peer
    bytes_refetched: int
    corrupt_pieces: int
    failed_sources: tuple[NodeId, ...]
    file_bytes: int  # extra files (config.json, tokenizer files)
    seconds: float


ProgressCallback = Callable[[TransferProgress], None]


@dataclass(eq=False)
class _Piece:
    tensor: str
    start: int
    stop: int
    nbytes: int
    sources: tuple[Source, ...]
    tried: set[NodeId] = field(default_factory=set)
    attempts: int = 0


async def fetch_manifest(
    session: aiohttp.ClientSession, base_url: str, secret: str, model: ModelIdentity
) -> ModelManifest:
    """A peer's manifest of ``model``, accepted only if signed with the cluster secret."""
    client = SignedClient(secret, session)
    try:
        manifest = await client.call(
            base_url, "/manifest", ModelRequest(model=model), ModelManifest, signed_reply=True
        )
    except PeerRefused as refused:
        raise TransferError(
            f"{base_url}: no manifest ({refused.status}: {refused.error})"
        ) from None
    except UnsignedReply:
        raise TransferError(
            f"{base_url}: the manifest is not signed with the cluster secret"
        ) from None
    if manifest.identity != model:
        raise TransferError(f"{base_url} sent the manifest of another model")
    return manifest


async def fetch_holding(
    session: aiohttp.ClientSession, base_url: str, secret: str, model: ModelIdentity
) -> Holding:
    """What a peer holds of ``model`` (PeerRefused if it answers with an error)."""
    return await SignedClient(secret, session).call(
        base_url, "/holdings", ModelRequest(model=model), Holding
    )


def split_fetch(
    manifest: ModelManifest, tensor: str, start: int, stop: int, limit: int
) -> list[tuple[int, int]]:
    """[start, stop) as runs of whole blocks of at most ``limit`` bytes (at least a block)."""
    entry = manifest.tensor(tensor)
    out, lo = [], start
    for b in entry.blocks(start, stop):
        if entry.cuts[b] > lo and (entry.cuts[b + 1] - lo) * entry.unit_bytes > limit:
            out.append((lo, entry.cuts[b]))
            lo = entry.cuts[b]
    if stop > lo:
        out.append((lo, stop))
    return out


class _Fetcher:
    def __init__(
        self,
        transfer: NodeTransfer,
        manifest: ModelManifest,
        store: ShardStore,
        peers: Mapping[str, str],
        secret: str,
        session: aiohttp.ClientSession,
        on_progress: ProgressCallback | None,
        request_bytes: int,
        per_source: int,
    ):
        self.transfer, self.manifest, self.store = transfer, manifest, store
        self.peers, self.client = peers, SignedClient(secret, session)
        self.on_progress, self.request_bytes, self.per_source = (
            on_progress,
            request_bytes,
            per_source,
        )
        self.queues: dict[Source, deque[_Piece]] = defaultdict(deque)
        self.workers: dict[Source, list[asyncio.Task[None]]] = {}
        self.dead: set[NodeId] = set()
        self.failed: list[_Piece] = []
        self.cond = asyncio.Condition()
        self.outstanding = 0
        self.error: Exception | None = None
        self.total = self.done = self.refetched = self.corrupt = 0
        self.by_source: dict[NodeId, int] = defaultdict(int)
        self.started = time.monotonic()
        self.samples: deque[tuple[float, int]] = deque([(self.started, 0)])
        self.last_report = 0.0

    # ---- routing (call with self.cond held) ----------------------------------------------

    def _route(self, piece: _Piece) -> None:
        alive = [s for s in piece.sources if s.node not in self.dead and s.node in self.peers]
        fresh = [s for s in alive if s.node not in piece.tried]
        source = (
            fresh[0] if fresh else alive[0] if alive and piece.attempts < MAX_ATTEMPTS else None
        )
        if source is None:
            self.failed.append(piece)
            self.outstanding -= 1
        else:
            self.queues[source].append(piece)
            if source not in self.workers:
                self.workers[source] = [
                    asyncio.create_task(self._worker(source)) for _ in range(self.per_source)
                ]
        self.cond.notify_all()

    def _drop(self, node: NodeId, batch: list[_Piece]) -> None:
        if node not in self.dead:
            log.warning("weights: source %s failed; its pieces go to other peers", node)
        self.dead.add(node)
        orphans = list(batch)
        for source, queue in self.queues.items():
            if source.node == node:
                orphans += queue
                queue.clear()
        for piece in orphans:
            self._route(piece)

    # ---- workers -------------------------------------------------------------------------

    async def _worker(self, source: Source) -> None:
        queue = self.queues[source]
        while True:
            async with self.cond:
                await self.cond.wait_for(
                    lambda: (
                        bool(queue)
                        or self.outstanding == 0
                        or source.node in self.dead
                        or self.error is not None
                    )
                )
                if (
                    source.node in self.dead
                    or self.error is not None
                    or (not queue and self.outstanding == 0)
                ):
                    return
                batch: list[_Piece] = []
                size = 0
                while queue and (not batch or size + queue[0].nbytes <= self.request_bytes):
                    piece = queue.popleft()
                    batch.append(piece)
                    size += piece.nbytes
            try:
                await self._request(source, batch)
            except Exception as error:  # the store's disk, or a bug: stop the whole transfer
                async with self.cond:
                    self.error = error
                    self.cond.notify_all()
                return

    async def _request(self, source: Source, batch: list[_Piece]) -> None:
        ask = ReadRequest(
            model=self.manifest.identity,
            source=source.kind,
            requester=self.transfer.node,
            pieces=tuple(Piece(tensor=p.tensor, start=p.start, stop=p.stop) for p in batch),
        )
        left = list(batch)
        try:
            async with self.client.stream(self.peers[source.node], "/read", ask) as response:
                while left:
                    piece = left[0]
                    piece.attempts += 1
                    data = await response.content.readexactly(piece.nbytes)
                    bad = await asyncio.to_thread(
                        self.store.write_piece, piece.tensor, piece.start, piece.stop, data
                    )
                    left.pop(0)
                    async with self.cond:
                        if bad:
                            log.warning(
                                "weights: %s[%d:%d] from %s failed its digests; fetching it again",
                                piece.tensor,
                                piece.start,
                                piece.stop,
                                source.node,
                            )
                            self.corrupt += 1
                            self.refetched += piece.nbytes
                            piece.tried.add(source.node)
                            self._route(piece)
                        else:
                            self.done += piece.nbytes
                            self.by_source[source.node] += piece.nbytes
                            self.outstanding -= 1
                            self.cond.notify_all()
                    self._progress()
        except PeerRefused as refused:
            if refused.status not in (404, 409):  # a server error: the source is broken
                await self._failed(source, left, f"HTTP {refused.status}")
                return
            log.warning("weights: %s refused pieces: %s", source.node, refused.error)
            async with self.cond:
                for piece in left:
                    piece.tried.add(source.node)
                    piece.attempts = MAX_ATTEMPTS  # it does not hold them: never ask it again
                    self._route(piece)
        except (
            aiohttp.ClientError,
            asyncio.TimeoutError,
            asyncio.IncompleteReadError,
            ConnectionError,
        ) as failure:
            await self._failed(source, left, type(failure).__name__)

    async def _failed(self, source: Source, left: list[_Piece], why: str) -> None:
        log.warning("weights: %s failed mid-transfer (%s)", source.node, why)
        async with self.cond:
            self.refetched += sum(p.nbytes for p in left)
            self._drop(source.node, left)

    # ---- progress ------------------------------------------------------------------------

    def progress(self, done: bool = False) -> TransferProgress:
        now = time.monotonic()
        self.samples.append((now, self.done))
        while len(self.samples) > 2 and now - self.samples[0][0] > RATE_WINDOW_S:
            self.samples.popleft()
        (t0, b0), (t1, b1) = self.samples[0], self.samples[-1]
        rate = (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0
        left = self.total - self.done
        return TransferProgress(
            node=self.transfer.node,
            model=self.manifest.identity,
            bytes_done=self.done,
            bytes_total=self.total,
            bytes_refetched=self.refetched,
            corrupt_pieces=self.corrupt,
            rate_bytes_s=rate,
            eta_s=left / rate if rate > 0 else (0.0 if not left else None),
            failed_sources=tuple(sorted(self.dead)),
            done=done,
        )

    def _progress(self, final: bool = False) -> None:
        now = time.monotonic()
        if self.on_progress and (final or now - self.last_report >= PROGRESS_EVERY_S):
            self.last_report = now
            self.on_progress(self.progress(done=final))

    # ---- the whole transfer --------------------------------------------------------------

    async def fetch_files(self) -> int:
        fetched = 0
        for extra in self.manifest.extra_files:
            if self.store.has_file(extra.name):
                continue
            for source in self.transfer.file_sources:
                if source.node in self.dead or source.node not in self.peers:
                    continue
                ask = FileRequest(
                    model=self.manifest.identity, name=extra.name, requester=self.transfer.node
                )
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, PeerRefused):
                    data = await self.client.read(self.peers[source.node], "/file", ask)
                    if await asyncio.to_thread(self.store.write_file, extra.name, data):
                        fetched += len(data)
                        break
            else:
                raise TransferError(f"no peer could send {extra.name}")
        return fetched

    async def run(self, piece_limit: int) -> None:
        pieces = [
            _Piece(
                tensor=f.tensor,
                start=a,
                stop=b,
                nbytes=piece_bytes(self.manifest.tensor(f.tensor), a, b),
                sources=f.sources,
            )
            for f in self.transfer.fetches
            for a, b in split_fetch(self.manifest, f.tensor, f.start, f.stop, piece_limit)
            if not self.store.held.covers(Boxes(ranges={f.tensor: ((a, b),)}))
        ]
        self.total = sum(p.nbytes for p in pieces)
        async with self.cond:
            self.outstanding = len(pieces)
            for piece in pieces:
                self._route(piece)
        try:
            await self._wait()
        except asyncio.CancelledError:  # the node moved on (a new epoch): stop every request
            tasks = [t for ts in self.workers.values() for t in ts]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        self._progress(final=True)

    async def _wait(self) -> None:
        while True:
            async with self.cond:
                await self.cond.wait_for(lambda: self.outstanding == 0 or self.error is not None)
            tasks = [t for ts in self.workers.values() for t in ts]
            if self.error is not None:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise TransferError(
                    f"cannot store {self.transfer.node}'s shard: {self.error}"
                ) from self.error
            await asyncio.gather(*tasks)
            # Routing during the last gather may have started new workers.
            if all(t.done() for ts in self.workers.values() for t in ts):
                break


async def fetch_transfer(
    transfer: NodeTransfer,
    manifest: ModelManifest,
    store: ShardStore,
    peers: Mapping[str, str],
    secret: str,
    *,
    session: aiohttp.ClientSession | None = None,
    on_progress: ProgressCallback | None = None,
    piece_limit: int = PIECE_BYTES,
    request_bytes: int = REQUEST_BYTES,
    per_source: int = PER_SOURCE,
    read_timeout: float = 30.0,
) -> FetchReport:
    """Bring ``store`` to hold ``transfer``'s share. ``peers``: node id -> base URL of its
    weight routes (``http://host:port/weights``). Raises TransferError if some piece could
    not be fetched from any peer."""
    started = time.monotonic()
    own = session is None
    if session is None:
        session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=read_timeout)
        )
    try:
        fetcher = _Fetcher(
            transfer,
            manifest,
            store,
            peers,
            secret,
            session,
            on_progress,
            request_bytes,
            per_source,
        )
        file_bytes = await fetcher.fetch_files()
        await fetcher.run(piece_limit)
    finally:
        if own:
            await session.close()
    if fetcher.failed:
        lost = sum(p.nbytes for p in fetcher.failed)
        raise TransferError(
            f"{len(fetcher.failed)} pieces ({lost} bytes) of {transfer.node}'s "
            f"shard could not be fetched (failed sources: "
            f"{', '.join(sorted(fetcher.dead)) or 'none'})"
        )
    return FetchReport(
        node=transfer.node,
        model=manifest.identity,
        bytes_fetched=fetcher.done,
        bytes_by_source=dict(fetcher.by_source),
        bytes_refetched=fetcher.refetched,
        corrupt_pieces=fetcher.corrupt,
        failed_sources=tuple(sorted(fetcher.dead)),
        file_bytes=file_bytes,
        seconds=time.monotonic() - started,
    )
