"""One exo-tp node: a daemon that wires its parts together.

- the signed control server (`control_app`) peers and the leader call: its handlers
  (`ControlHandlers`: ports, assignments, releases) and the weight routes (`NodeWeights`: the
  model folders it was given, its shard stores, fetching its shard),
- `NodeWorker` (this node's rank process for the current epoch),
- `Peers` (discovery, membership, the status poll), `ClusterModel` (which model, whose weights
  move where) and `Leader` (formation, while this node leads), together `Joined`,
- `Dispatcher` (the leader's request source) and `ModelRequests` (models requests asked for),
- `StatusViews` (what the node shows its peers and the API) and `NodeBackend` (the public API's
  `Backend`: the one place that speaks HTTP errors).
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from aiohttp import web

from exo_tp import __version__
from exo_tp.api.routes import build_public_app
from exo_tp.finetune.state import FineTuneState, state_root
from exo_tp.node.backend import NodeBackend
from exo_tp.node.cluster.config import NodeConfig
from exo_tp.node.cluster.control import ControlClient, control_app
from exo_tp.node.cluster.control_messages import NodeStatus
from exo_tp.node.cluster.memory import memory_now
from exo_tp.node.cluster.peers import Peers
from exo_tp.node.finetune.jobs import FineTuning
from exo_tp.node.finetune.ranks import FINETUNE_MOUNT, FinetuneRanks, finetune_app
from exo_tp.node.joined import Joined
from exo_tp.node.leader.cluster_model import ClusterModel
from exo_tp.node.leader.dispatch import Dispatcher
from exo_tp.node.leader.epochs import EpochNumbers
from exo_tp.node.leader.formation import Leader
from exo_tp.node.leader.group_slots import MAIN_SLOT, GroupSlot
from exo_tp.node.leader.model_requests import ModelRequests
from exo_tp.node.leader.resident import ResidentGroups
from exo_tp.node.listeners import Listeners, guard_cluster_app, mount_forwarded_api
from exo_tp.node.member.control_handlers import ControlHandlers
from exo_tp.node.member.hub_downloads import HubDownloads
from exo_tp.node.member.link_probes import LinkProbes
from exo_tp.node.member.weights import NodeWeights
from exo_tp.node.member.worker import NodeWorker
from exo_tp.node.model_catalog import ModelCatalog
from exo_tp.node.status_views import StatusViews
from exo_tp.weights.server import MOUNT
from exo_tp.wire.announcement import Announcement
from exo_tp.wire.ids import NodeId
from exo_tp.wire.profiles import ProfileSummary

log = logging.getLogger(__name__)


class Node:
    def __init__(
        self, config: NodeConfig, weights: NodeWeights, profile: ProfileSummary | None = None
    ):
        self.config, self.weights, self.profile = config, weights, profile
        self.control = ControlClient(config.secret)
        self.worker = NodeWorker(config.secret, config.stall_timeout)
        self.dispatcher = self._dispatcher()
        self.requests = ModelRequests()
        self.handlers = ControlHandlers(config, self.worker, weights)
        self.views = StatusViews(
            config, profile, self.worker, weights, self.dispatcher, self.handlers
        )
        finetune_state = FineTuneState(state_root(config.node_id))
        self.finetune_ranks = self.views.finetune_ranks = FinetuneRanks(
            config.node_id,
            self.worker,
            weights,
            finetune_state,
            self._leader_id,
            self.handlers.weight_urls,
        )
        self.handlers.adapters = finetune_state.adapter_dir
        self.fine_tuning = FineTuning(
            config.node_id,
            config.secret,
            finetune_state,
            self.finetune_ranks,
            self.views,
            self.control,
        )
        self.downloads = self.views.downloads = HubDownloads(weights)
        self.backend = NodeBackend(
            self.views,
            self.dispatcher,
            self.requests,
            config.defaults,
            self.downloads,
            ModelCatalog(config.models_dirs),
            self.fine_tuning,
        )
        self.joined: Joined | None = None
        self.listeners = Listeners()  # the public API's and the cluster's, apart
        self.views.listeners = self.listeners
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None

    @property
    def node_id(self) -> NodeId:
        return self.config.node_id

    async def start(self, public_routes: web.RouteTableDef) -> None:
        self._session = self.views.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=3)
        )
        api_limits, cluster_limits = self.config.api_limits, self.config.cluster_limits
        host = self.config.listen_host
        control_port = await self.listeners.serve_cluster(
            self._control_app(), host, self.config.control_port, cluster_limits
        )
        requests_port = await self.dispatcher.start()
        public = build_public_app(
            self.backend, public_routes, self.config.access, api_limits.body_timeout
        )
        await self.listeners.serve_api(
            public, host, self.config.api_port, api_limits, handler_cancellation=True
        )
        me = self._announcement(control_port)
        peers = Peers(me, self.config.secret, self.config.host, self.control, self._status)
        models = ClusterModel(self.node_id, self.weights, peers, self.config.secret)
        epochs = EpochNumbers(lambda: self.handlers.epoch_seen)

        def group_leader(slot: GroupSlot, dispatcher: Dispatcher, port: int) -> Leader:
            control, requests = self.control, self.requests
            return Leader(
                self.config, models, peers, control, dispatcher, port, epochs, requests, slot
            )

        leader = group_leader(MAIN_SLOT, self.dispatcher, requests_port)
        groups = ResidentGroups(
            leader, group_leader, self._dispatcher, self.config.max_models, self.config.replicas
        )
        self.joined = self.views.joined = Joined(peers, models, leader, groups)
        self.handlers.peers = peers
        probes = self.views.probes = LinkProbes(me, self.control)
        await peers.start()
        self._tasks = [
            asyncio.create_task(self._maintain(peers), name="maintain"),
            asyncio.create_task(probes.probe_forever(peers.alive), name="link probes"),
            asyncio.create_task(leader.run_forever(), name="leader"),
            asyncio.create_task(groups.run_forever(), name="resident groups"),
        ]
        log.info(
            "node %s up: api %s, control port %d, cluster %r",
            self.node_id,
            me.api_url,
            control_port,
            self.config.cluster,
        )

    def _control_app(self) -> web.Application:
        handlers = self.handlers
        app = control_app(
            self.config.secret,
            self._status_async,
            handlers.ports,
            handlers.assign,
            handlers.release,
        )
        app.add_subapp(MOUNT, self.weights.app())
        app.add_subapp(FINETUNE_MOUNT, finetune_app(self.config.secret, self.finetune_ranks))
        # Requests a member passes on to the leader arrive here, signed, on the cluster's own
        # listener: a flood of the leader's public API cannot block them.
        limits = self.config.cluster_limits
        forwarded = build_public_app(
            self.backend, web.RouteTableDef(), self.config.access, limits.body_timeout
        )
        mount_forwarded_api(app, forwarded)
        guard_cluster_app(app, limits)
        return app

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.joined is not None:
            await self.joined.groups.close()
        await self.fine_tuning.close()
        await self.finetune_ranks.close()
        await self.handlers.close()
        await self.downloads.close()
        await self.weights.close()
        self.dispatcher.stop()
        if self.joined is not None:
            await self.joined.peers.stop()
        await self.listeners.close()
        await self.control.close()
        if self._session is not None:
            await self._session.close()

    def _dispatcher(self) -> Dispatcher:
        """A request source for one group (the main one's, or another resident model's)."""
        config = self.config
        return Dispatcher(
            config.secret.encode(),
            config.listen_host,
            config.serving.max_concurrency,
            config.max_queue,
        )

    def _leader_id(self) -> str | None:
        return self.joined.peers.leader_id() if self.joined else None

    def _status(self) -> NodeStatus:
        return self.views.node_status()

    async def _status_async(self) -> NodeStatus:
        return self.views.node_status()

    def _announcement(self, control_port: int) -> Announcement:
        memory = memory_now(None)  # at start; status polls report it live
        profile = self.profile
        return Announcement(
            node_id=self.node_id,
            version=__version__,
            cluster=self.config.cluster,
            host=self.config.host,
            api_port=self.config.api_port,
            control_port=control_port,
            memory_total=memory["total"] or 0,
            memory_available=min(memory["available"] or 0, self.config.max_memory or 2**62),
            decode_seconds_per_byte=profile.decode_seconds_per_byte if profile else 0.0,
            prefill_flops=profile.prefill_flops if profile else 0.0,
            layer_overhead_seconds=profile.layer_overhead_seconds if profile else 0.0,
            weight=self.config.weight,
            started=self.views.started,
        )

    async def _maintain(self, peers: Peers) -> None:
        """Poll the peers (every second, faster while the cluster changes); let a worker go
        once its leader is gone."""
        assert self.joined is not None
        while True:
            try:
                await peers.poll_once()
                await self.handlers.drop_orphan()
                await self.finetune_ranks.drop_orphan(peers.alive_ids())
            except Exception:  # a bug: without this loop the node drops out of the cluster
                log.exception("maintenance round failed")
            await asyncio.sleep(peers.poll_interval(self.joined.leader.forming()))
