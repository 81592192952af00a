"""Which model the cluster serves, and how its weights reach the nodes of an epoch.

Every node offers the models it has the files of (NodeStatus.weights); any of them can be served
(the cluster serves one at a time). The leader serves a model asked for by a request, else the
one it serves now, else its own first ``--model``, else the first ``--model`` of the member with
the smallest id. To form an epoch it prepares the model (config and tokenizer on this node:
its files, else a store whose extra files it fetches from a holder), and gives each node a
WeightOrder: when every node of the plan has the files, only the model's key; otherwise every
holder computes (once) the manifest and the leader gathers every member's holdings, which
placement (exo_tp.node.leader.placement) turns into the rank order and the transfer plan; each node
gets its part.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo_tp.vision.families import NoImages

if TYPE_CHECKING:
    from exo_tp.vision.prompt import ImagePrompter

from exo_tp.errors import ExoTpError
from exo_tp.frozen import replace
from exo_tp.node.cluster.peers import Peers
from exo_tp.node.cluster.weight_orders import ModelOffer, WeightOrder
from exo_tp.node.leader.placement import Holdings, Placement
from exo_tp.node.member.peer_manifests import ManifestPending, manifest_of, weights_url
from exo_tp.node.member.weights import NodeWeights
from exo_tp.plan import ModelSpec, load_spec
from exo_tp.weights.boxes import whole
from exo_tp.weights.client import fetch_holding
from exo_tp.weights.manifest import ModelManifest
from exo_tp.weights.transfer import Holding, TransferError, TransferPlan, plan_shares
from exo_tp.wire.announcement import Announcement
from exo_tp.wire.errors import PeerRefused
from exo_tp.wire.ids import ModelKey, NodeId

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prepared:
    """A model ready to plan and tokenize for on this node."""

    key: ModelKey
    name: str
    folder: Path  # its config.json and tokenizer files on this node
    spec: ModelSpec
    tokenizer: TokenizerWrapper
    # a vision checkpoint's processor (exo_tp.vision); NoImages: a tower the cluster does not run
    images: ImagePrompter | NoImages | None = None


def transfer_orders(model: Prepared, transfer: TransferPlan) -> dict[NodeId, WeightOrder]:
    """Each node's WeightOrder: the model, and its part of ``transfer``."""
    return {
        n: WeightOrder(
            key=model.key, name=model.name, identity=transfer.model, transfer=transfer.node(n)
        )
        for n in transfer.order
    }


def _load(folder: Path) -> tuple[ModelSpec, TokenizerWrapper, ImagePrompter | NoImages | None]:
    from exo_tp.models.tokenizer import load_model_tokenizer
    from exo_tp.vision.families import unsupported_vision_family, vision_config

    images: ImagePrompter | NoImages | None = None
    if vision_config(folder) is not None:
        from exo_tp.vision.prompt import ImagePrompter

        images = ImagePrompter(folder)
    elif (why := unsupported_vision_family(folder)) is not None:
        images = NoImages(why)
    return load_spec(folder), load_model_tokenizer(folder), images


class ClusterModel:
    def __init__(self, me: NodeId, weights: NodeWeights, peers: Peers, secret: str):
        self.me, self.weights, self.peers, self.secret = me, weights, peers, secret
        self.current: Prepared | None = None  # of the latest epoch this node formed
        self._prepared: dict[str, Prepared] = {}

    # ---- what the cluster can serve ----------------------------------------------------------

    def offers(self, drafts: bool = True) -> dict[str, list[tuple[NodeId, ModelOffer]]]:
        """key -> (node, offer) for every alive member that has the model's files; without
        ``drafts``, only models some member offers as a model (not only as a draft)."""
        out: dict[str, list[tuple[NodeId, ModelOffer]]] = defaultdict(list)
        for node_id in self.peers.alive_ids():
            status = self.peers.status(node_id)
            for offer in status.weights.offers if status else ():
                if offer.files:
                    out[offer.key].append((node_id, offer))
        if drafts:
            return out
        return {k: hs for k, hs in out.items() if not all(o.draft for _, o in hs)}

    def name_of(self, key: str, offers: dict[str, list[tuple[NodeId, ModelOffer]]]) -> str:
        """This node's name for the model if it has one, else the smallest node id's."""
        if self.current is not None and self.current.key == key:
            return self.current.name
        holders = sorted(offers.get(key, []), key=lambda h: (h[0] != self.me, h[0]))
        return holders[0][1].name if holders else key[:12]

    def key_of(self, name: str, drafts: bool = False) -> str | None:
        """The model any member (or this node's current model) calls ``name`` (``drafts``:
        a draft model's too)."""
        if self.current is not None and self.current.name == name:
            return self.current.key
        for key, holders in self.offers(drafts).items():
            if any(offer.name == name for _, offer in holders):
                return key
        return None

    def listing(self) -> list[tuple[str, str]]:
        """(name, key) of every model some member can serve, by name."""
        offers = self.offers(drafts=False)
        return sorted((self.name_of(key, offers), key) for key in offers)

    def target(
        self, members: Sequence[NodeId], serving: str | None, wanted: str | None
    ) -> str | None:
        """The model to serve with these members: the one a request asked for (``wanted``),
        the one served now, the members' defaults, else any."""
        offers = self.offers(drafts=False)
        available = {k for k, hs in offers.items() if any(n in members for n, _ in hs)}
        defaults = []
        for node_id in sorted(members, key=lambda n: (n != self.me, n)):
            status = self.peers.status(node_id)
            if status is not None and status.weights.default is not None:
                defaults.append(status.weights.default)
        for key in (wanted, serving, *defaults):
            if key is not None and key in available:
                return key
        return min(available) if available else None

    # ---- preparing a model on the leader -----------------------------------------------------

    def _member(self, node_id: NodeId) -> Announcement | None:
        return self.peers.get(node_id)

    def urls(self) -> dict[str, str]:
        return {
            m.announcement.node_id: weights_url(m.announcement)
            for m in self.peers.membership.members.values()
        }

    async def _manifest_from(self, node_id: NodeId, key: str) -> ModelManifest:
        if node_id == self.me:
            return await self.weights.manifest(key)
        member = self._member(node_id)
        if member is None:
            raise TransferError(f"{node_id} is gone")
        return await manifest_of(self.weights.session, weights_url(member), self.secret, key)

    def prepared(self, key: str) -> Prepared | None:
        """``key`` as a group of this node prepared it last (None: not prepared here)."""
        return self._prepared.get(key)

    async def prepare(self, key: str, members: Sequence[NodeId], main: bool = True) -> Prepared:
        """Config and tokenizer of the model on this node (fetched from a holder if needed);
        ``main``: for the main group (the model the cluster serves by default, `current`)."""
        offers = self.offers()
        name = self.name_of(key, offers)
        folder = self.weights.local_dir(key)
        if folder is None:
            holders = [n for n, _ in sorted(offers.get(key, [])) if n in members]
            if not holders:
                raise TransferError(f"no member has the files of {name}")
            manifest = await self._first_manifest(holders, key)
            folder = await self.weights.extras(manifest, name, holders, self.urls())
        prepared = self._prepared.get(key)
        if prepared is None or prepared.folder != folder:
            spec, tokenizer, images = await asyncio.to_thread(_load, folder)
            prepared = Prepared(ModelKey(key), name, folder, spec, tokenizer, images)
            self._prepared[key] = prepared
        if main:
            self.current = prepared
        return prepared

    async def _first_manifest(self, holders: Sequence[NodeId], key: str) -> ModelManifest:
        failures = []
        for node_id in holders:
            try:
                return await self._manifest_from(node_id, key)
            except (aiohttp.ClientError, TimeoutError, ExoTpError, ValueError) as error:
                failures.append(f"{node_id}: {error}")
        raise TransferError("no holder sent the manifest: " + "; ".join(failures))

    # ---- the weights of an epoch -------------------------------------------------------------

    async def holdings(self, model: Prepared, eligible: Sequence[Announcement]) -> Holdings:
        """What the eligible members hold of the model: who has the files and, when some
        member lacks them, the manifest and each member's files or shard store."""
        offers = self.offers()
        eligible_ids = {m.node_id for m in eligible}
        holders = sorted(n for n, _ in offers.get(model.key, []) if n in eligible_ids)
        files = frozenset(holders)
        if eligible_ids <= files:
            return Holdings(files=files)
        manifests = await asyncio.gather(
            *(self._manifest_from(n, model.key) for n in holders), return_exceptions=True
        )
        pending = [
            n for n, m in zip(holders, manifests, strict=True) if isinstance(m, ManifestPending)
        ]
        if pending:  # wait for them (the epoch retries) rather than leave them out as sources
            raise ManifestPending(
                f"{', '.join(pending)} still computing the weight manifest of {model.name} "
                "(once per model folder)"
            )
        good = [
            (n, m) for n, m in zip(holders, manifests, strict=True) if isinstance(m, ModelManifest)
        ]
        for n, m in zip(holders, manifests, strict=True):
            if not isinstance(m, ModelManifest):
                log.warning("weights: %s cannot serve %s: %s", n, model.name, m)
        if not good:
            raise TransferError(
                f"no member could describe the weights of {model.name}: "
                + "; ".join(f"{n}: {m}" for n, m in zip(holders, manifests, strict=True))
            )
        manifest = next((m for n, m in good if n == self.me), good[0][1])
        held = [
            Holding(node=n, files=True, extras=True)
            for n, m in good
            if m.identity == manifest.identity
        ]
        others = [m for m in eligible if m.node_id not in {h.node for h in held}]
        held += await asyncio.gather(*(self._holding(m, manifest) for m in others))
        return Holdings(files=files, manifest=manifest, held=tuple(held))

    def orders(self, model: Prepared, placement: Placement) -> dict[NodeId, WeightOrder]:
        """Each chosen member's WeightOrder: the model, and its part of the transfers."""
        transfer = placement.transfers
        if transfer is None:  # every chosen member loads from its own files
            return {n: WeightOrder(key=model.key, name=model.name) for n in placement.rank_order}
        log.info(
            "weights of %s: %.1f MB move (%s); %.1f MB of the shares are on their nodes "
            "already (files or stores); rank order %s",
            model.name,
            transfer.moved_bytes / 1e6,
            ", ".join(
                f"{n} serves {b / 1e6:.1f} MB" for n, b in sorted(transfer.source_bytes.items())
            )
            or "nothing",
            transfer.retained_bytes / 1e6,
            list(placement.rank_order),
        )
        return transfer_orders(model, transfer)

    async def draft_order(self, name: str, conductor: Announcement) -> WeightOrder | None:
        """How the conductor's node gets the draft model ``name`` (speculative decoding): from
        its own files, else whole into its store from the members that offer it (as a shard
        of a one-rank plan). None when no member offers it: the conductor then resolves the
        name itself, and drafts by prompt lookup if it cannot (it logs why)."""
        key = self.key_of(name, drafts=True)
        if key is None:
            log.warning("no member offers the draft model %s", name)
            return None
        holders = sorted(n for n, _ in self.offers().get(key, []))
        if conductor.node_id in holders:
            return WeightOrder(key=ModelKey(key), name=name)
        manifest = await self._first_manifest(holders, key)
        held = [Holding(node=n, files=True, extras=True) for n in holders]
        held.append(await self._holding(conductor, manifest))
        transfer = plan_shares(manifest, [whole(manifest)], [conductor.node_id], held)
        log.info(
            "draft model %s: %.1f MB move to %s",
            name,
            transfer.moved_bytes / 1e6,
            conductor.node_id,
        )
        return WeightOrder(
            key=ModelKey(key),
            name=name,
            identity=transfer.model,
            transfer=transfer.node(conductor.node_id),
        )

    async def _holding(self, member: Announcement, manifest: ModelManifest) -> Holding:
        """What a member without the files holds of the model (its store, asked over HTTP)."""
        node_id = member.node_id
        if node_id == self.me:
            return self.weights.holding(manifest.identity)
        status = self.peers.status(node_id)
        held = status is not None and any(
            o.identity == manifest.identity and o.held_bytes > 0 for o in status.weights.offers
        )
        if not held:
            return Holding(node=node_id)
        try:
            holding = await fetch_holding(
                self.weights.session, weights_url(member), self.secret, manifest.identity
            )
        except (aiohttp.ClientError, TimeoutError, ValueError, PeerRefused) as error:
            log.warning(
                "weights: holdings of %s unknown (%s): it counts as holding nothing", node_id, error
            )
            return Holding(node=node_id)
        return replace(holding, node=node_id)
