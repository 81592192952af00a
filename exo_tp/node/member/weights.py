"""This node's model weights: the folders it was given (``--model``), its shard stores, the weight
routes it serves peers (mounted on its control server), and fetching its shard for an epoch.

A folder is known by its key (exo_tp.weights.key, headers only) until a peer needs its bytes:
then its manifest is computed once (``manifest_for``, cached on disk) and the folder is served.
Stores live in ``<exo-tp cache>/stores/<identity>`` with the manifest beside them, so a node that
restarts still offers (and serves) what it received. A node locks the stores it uses: a second
node on the same machine and cache gets its own (``<identity>-<node id>``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

import aiohttp
from aiohttp import web

from exo_tp.atomic_file import write_atomically
from exo_tp.errors import ExoTpError
from exo_tp.frozen import replace
from exo_tp.node.cluster.weight_orders import (
    FetchState,
    FetchSummary,
    ModelOffer,
    WeightOrder,
    WeightsStatus,
)
from exo_tp.node.member.peer_manifests import ManifestOf
from exo_tp.node.member.weight_folders import STORE_INFO, OwnFolder, StoreInfo, claim, weight_bytes
from exo_tp.paths import cache_home
from exo_tp.weights.boxes import Boxes
from exo_tp.weights.build import manifest_for
from exo_tp.weights.client import fetch_manifest, fetch_transfer
from exo_tp.weights.key import folder_key, manifest_key
from exo_tp.weights.manifest import ModelManifest
from exo_tp.weights.server import ServedModel, ServeOptions, WeightServer
from exo_tp.weights.store import ShardStore, store_root
from exo_tp.weights.transfer import Holding, NodeTransfer, Source, TransferError
from exo_tp.wire.errors import PeerRefused
from exo_tp.wire.http import post, signed_app
from exo_tp.wire.ids import Epoch, ModelIdentity, ModelKey, NodeId, Rank
from exo_tp.wire.weights import TransferProgress

log = logging.getLogger(__name__)

RECENT_FETCHES = 4
LOG_EVERY_S = 2.0
MANIFEST_WAIT_S = 20.0  # a peer asking for a manifest waits this long, then retries later
# Test-only: "1" enables /weights/test-options (flip bytes, slow down what this node serves).
TEST_FAULTS_ENV = "EXO_TP_TEST_FAULTS"
TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=30)


def source_nodes(transfer: NodeTransfer) -> list[NodeId]:
    """The peers a transfer names, the extra files' sources first (they have the manifest)."""
    named: list[Source] = [*transfer.file_sources]
    named += [s for f in transfer.fetches for s in f.sources]
    return list(dict.fromkeys(s.node for s in named))


class NodeWeights:
    def __init__(self, node_id: NodeId, secret: str, folders: Sequence[tuple[str, Path]] = ()):
        self.node_id, self.secret = node_id, secret
        self.server = WeightServer(node_id, secret)
        self.folders: dict[str, OwnFolder] = {}
        for name, folder in folders:
            key = folder_key(folder)
            self.folders.setdefault(key, OwnFolder(name, Path(folder), key, weight_bytes(folder)))
        self.default = folder_key(folders[0][1]) if folders else None
        self.stores: dict[str, tuple[str, ShardStore]] = {}  # identity -> (name, store)
        self.fetch: FetchSummary | None = None
        self.recent: deque[FetchSummary] = deque(maxlen=RECENT_FETCHES)
        self._session: aiohttp.ClientSession | None = None
        self._logged = 0.0
        self._keys: dict[str, ModelKey] = {}  # identity of a store's manifest -> its key
        self._locks: list[IO[str]] = []
        self._creating = asyncio.Lock()
        self._open_stores()

    def _open_stores(self) -> None:
        """Serve, one per model, the stores left by earlier runs that this node may use: its
        own (``<model>-<node id>``, first) or the shared one (``<model>``). Another node's
        named store is never taken: a node that cannot claim the shared store falls back to
        its own name only (`_create`), so taking it left that node with no store at all (its
        epoch failed: "in use by another process")."""
        found = sorted(
            (cache_home() / "stores").glob(f"*/{STORE_INFO}"),
            key=lambda path: not path.parent.name.endswith(f"-{self.node_id}"),
        )
        for info_path in found:
            try:
                info = StoreInfo.model_validate_json(info_path.read_text())
            except (OSError, ValueError) as error:
                log.warning("not using the shard store %s: %s", info_path.parent, error)
                continue
            identity = info.manifest.identity
            if identity in self.stores or info_path.parent not in self._store_roots(identity):
                continue  # one store per model; the others are other nodes' or spare
            lock = claim(info_path.parent)
            if lock is None:
                continue  # another node on this machine uses it
            try:
                self._serve_store(info.name, ShardStore(info_path.parent, info.manifest))
            except (OSError, ValueError, ExoTpError) as error:
                log.warning("not using the shard store %s: %s", info_path.parent, error)
                lock.close()
                continue
            self._locks.append(lock)

    def _serve_store(self, name: str, store: ShardStore) -> None:
        self.stores[store.manifest.identity] = (name, store)
        self._keys[store.manifest.identity] = manifest_key(store.manifest)
        self.server.serve(ServedModel(store.manifest, store=store))

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=TIMEOUT)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        for _, store in self.stores.values():
            store.close()
        for lock in self._locks:
            lock.close()

    def add_folder(self, name: str, folder: Path, draft: bool = False) -> str:
        """A model folder this node got while running (a hub download), or a draft model
        (``draft``: offered for conductors to fetch, not served on its own): offered from the
        next status poll on. Returns its key."""
        key = folder_key(folder)
        own = OwnFolder(name, Path(folder), key, weight_bytes(folder), draft=draft)
        self.folders.setdefault(key, own)
        return key

    # ---- what this node has ---------------------------------------------------------------

    def folder(self, key: str) -> Path | None:
        own = self.folders.get(key)
        return own.folder if own else None

    def _store_for_key(self, key: str) -> ShardStore | None:
        for identity, (_, store) in self.stores.items():
            if self._keys[identity] == key:
                return store
        return None

    def local_dir(self, key: str) -> Path | None:
        """A folder holding the model's config and tokenizer: its files, else a store."""
        if (folder := self.folder(key)) is not None:
            return folder
        store = self._store_for_key(key)
        return store.folder if store is not None and store.extra_files_complete else None

    def holding(self, identity: str) -> Holding:
        if any(o.manifest and o.manifest.identity == identity for o in self.folders.values()):
            return Holding(node=self.node_id, files=True, extras=True)
        if identity in self.stores:
            return self.stores[identity][1].holding(self.node_id)
        return Holding(node=self.node_id)

    def status(self) -> WeightsStatus:
        offers = [
            ModelOffer(
                name=own.name,
                key=own.key,
                files=True,
                identity=own.manifest.identity if own.manifest else None,
                held_bytes=own.weight_bytes,
                total_bytes=own.weight_bytes,
                draft=own.draft,
            )
            for own in self.folders.values()
        ]
        for identity, (name, store) in self.stores.items():
            manifest = store.manifest
            key = self._keys[identity]
            if key not in self.folders:
                offers.append(
                    ModelOffer(
                        name=name,
                        key=key,
                        files=False,
                        identity=manifest.identity,
                        held_bytes=store.held.nbytes(manifest),
                        total_bytes=manifest.total_bytes,
                    )
                )
        return WeightsStatus(
            default=self.default,
            offers=tuple(offers),
            fetch=self.fetch,
            recent=tuple(self.recent),
            served=self.server.stats(),
        )

    # ---- manifests ------------------------------------------------------------------------

    async def manifest(self, key: str) -> ModelManifest:
        """The manifest of this node's folder with ``key``: computed once (cached on disk),
        then the folder is served to peers."""
        own = self.folders.get(key)
        if own is None:
            raise ExoTpError(f"{self.node_id} has no model folder with key {key[:12]}")
        if own.manifest is None:
            if own.computing is None:
                own.computing = asyncio.ensure_future(asyncio.to_thread(manifest_for, own.folder))
            try:
                manifest = await asyncio.shield(own.computing)
            except Exception:
                own.computing = None
                raise
            own.manifest = manifest
            self.server.serve(ServedModel(manifest, folder=own.folder))
        return own.manifest

    def _known_manifest(self, identity: str) -> ModelManifest | None:
        if identity in self.stores:
            return self.stores[identity][1].manifest
        for own in self.folders.values():
            if own.manifest is not None and own.manifest.identity == identity:
                return own.manifest
        return None

    async def manifest_from(
        self, identity: ModelIdentity, sources: Sequence[NodeId], peers: Mapping[str, str]
    ) -> ModelManifest:
        """The manifest of ``identity``: known here, else from the first peer that sends it."""
        if (known := self._known_manifest(identity)) is not None:
            return known
        failures = []
        for node in sources:
            if node not in peers:
                continue
            try:
                return await fetch_manifest(self.session, peers[node], self.secret, identity)
            except (aiohttp.ClientError, TimeoutError, ExoTpError, ValueError) as error:
                failures.append(f"{node}: {error}")
        raise TransferError(f"no peer sent the manifest of {identity[:12]}: {failures}")

    async def _store(self, manifest: ModelManifest, name: str) -> ShardStore:
        async with self._creating:  # one store per model, however many ask at once
            if manifest.identity not in self.stores:
                self._serve_store(name, await asyncio.to_thread(self._create, manifest, name))
        return self.stores[manifest.identity][1]

    def _store_roots(self, identity: str) -> tuple[Path, Path]:
        """The stores of a model this node may use: the shared one, then its own (when
        another node on this machine and cache holds the shared one)."""
        shared = store_root(identity)
        return shared, shared.with_name(f"{shared.name}-{self.node_id}")

    def _create(self, manifest: ModelManifest, name: str) -> ShardStore:
        shared, own = self._store_roots(manifest.identity)
        root, lock = shared, claim(shared)
        if lock is None:
            root, lock = own, claim(own)
        if lock is None:
            raise ExoTpError(f"the shard store {root} is in use by another process")
        self._locks.append(lock)
        info = StoreInfo(name=name, manifest=manifest)
        write_atomically(root / STORE_INFO, info.model_dump_json())
        return ShardStore(root, manifest)

    async def extras(
        self,
        manifest: ModelManifest,
        name: str,
        sources: Sequence[NodeId],
        peers: Mapping[str, str],
    ) -> Path:
        """A store holding the model's config and tokenizer files (the leader tokenizes)."""
        store = await self._store(manifest, name)
        if not store.extra_files_complete:
            files_only = NodeTransfer(
                node=self.node_id,
                rank=Rank(0),
                load_from="store",
                share=Boxes(),
                retained=Boxes(),
                fetches=(),
                file_sources=tuple(Source(node=n, kind="files") for n in sources),
            )
            await fetch_transfer(
                files_only, manifest, store, peers, self.secret, session=self.session
            )
        return store.folder

    # ---- an epoch's shard -----------------------------------------------------------------

    async def receive(self, order: WeightOrder, epoch: Epoch, peers: Mapping[str, str]) -> Path:
        """The folder this node's worker loads from: its own files, or its store once it holds
        the transfer's share (fetched from peers, progress logged and in the status)."""
        transfer = order.transfer
        if transfer is None or transfer.load_from == "files" or order.identity is None:
            folder = self.folder(order.key)
            if folder is None:
                raise ExoTpError(f"{self.node_id} has no files of {order.name}")
            return folder
        manifest = await self.manifest_from(order.identity, source_nodes(transfer), peers)
        store = await self._store(manifest, order.name)
        summary = FetchSummary(
            epoch=epoch,
            key=order.key,
            name=order.name,
            state="fetching",
            share_bytes=transfer.share.nbytes(manifest),
            retained_bytes=transfer.retained.nbytes(manifest),
            planned_bytes=transfer.fetch_bytes(manifest),
        )
        if self.fetch is not None:
            self.recent.appendleft(self.fetch)
        self.fetch = summary
        log.info(
            "weights: epoch %d, %s: fetching %.1f MB of my %.1f MB share (%.1f MB in my store)",
            epoch,
            order.name,
            summary.planned_bytes / 1e6,
            summary.share_bytes / 1e6,
            summary.retained_bytes / 1e6,
        )
        started = time.monotonic()

        def progress(update: TransferProgress) -> None:
            if self.fetch is not None and self.fetch.epoch == epoch:
                self.fetch = replace(self.fetch, progress=update)
            now = time.monotonic()
            if update.done or now - self._logged >= LOG_EVERY_S:
                self._logged = now
                log.info("weights: %s", update.line())

        def finish(state: FetchState, error: str | None = None) -> None:
            if self.fetch is not None and self.fetch.epoch == epoch:
                self.fetch = replace(
                    self.fetch, state=state, error=error, seconds=time.monotonic() - started
                )

        try:
            report = await fetch_transfer(
                transfer,
                manifest,
                store,
                peers,
                self.secret,
                session=self.session,
                on_progress=progress,
            )
            store.require(transfer.share)
        except asyncio.CancelledError:
            finish("cancelled")
            raise
        except (ExoTpError, aiohttp.ClientError, OSError, TimeoutError) as error:
            finish("failed", str(error) or type(error).__name__)
            raise ExoTpError(f"cannot fetch my shard of {order.name}: {error}") from None
        finish("done")
        log.info(
            "weights: epoch %d: %.1f MB received in %.1f s (%s)%s",
            epoch,
            report.bytes_fetched / 1e6,
            report.seconds,
            ", ".join(f"{n}: {b / 1e6:.1f} MB" for n, b in sorted(report.bytes_by_source.items()))
            or "nothing to fetch",
            f"; refetched {report.bytes_refetched / 1e6:.1f} MB "
            f"({report.corrupt_pieces} corrupt pieces, failed: "
            f"{', '.join(report.failed_sources) or 'none'})"
            if report.bytes_refetched
            else "",
        )
        return store.folder

    def failed(self, epoch: Epoch, order: WeightOrder, error: str) -> None:
        """Record a failure before the fetch started (no manifest, no store): the leader sees
        it in this node's status and fails the epoch."""
        if self.fetch is not None and self.fetch.epoch == epoch:
            if self.fetch.state == "fetching":
                self.fetch = replace(self.fetch, state="failed", error=error)
            return
        if self.fetch is not None:
            self.recent.appendleft(self.fetch)
        self.fetch = FetchSummary(
            epoch=epoch,
            key=order.key,
            name=order.name,
            state="failed",
            share_bytes=0,
            retained_bytes=0,
            planned_bytes=0,
            error=error,
        )

    # ---- routes ---------------------------------------------------------------------------

    def app(self) -> web.Application:
        """The weight routes (signed), to mount at exo_tp.weights.server.MOUNT."""
        routes = [
            *self.server.routes(),
            post("/manifest-of", ManifestOf, self._manifest_of, sign_reply=True),
        ]
        if os.environ.get(TEST_FAULTS_ENV) == "1":
            routes.append(post("/test-options", ServeOptions, self._test_options))
        return signed_app(self.secret, routes)

    async def _manifest_of(self, ask: ManifestOf) -> ModelManifest:
        if ask.key not in self.folders:
            raise PeerRefused(f"no model folder with key {ask.key[:12]} here", 404)
        try:
            return await asyncio.wait_for(asyncio.shield(self.manifest(ask.key)), MANIFEST_WAIT_S)
        except TimeoutError:  # 503: ask again later
            raise PeerRefused(
                f"{self.node_id} is still computing the weight manifest", 503
            ) from None
        except ExoTpError as error:
            raise PeerRefused(str(error)) from None

    async def _test_options(self, options: ServeOptions) -> ServeOptions:
        self.server.configure(options)
        log.warning("weights: test options %s", options.model_dump_json())
        return options
