"""One exo-tp node: wires its parts together and shows the public API a view of them.

- `Peers` (discovery, membership, the status poll),
- the signed control server (`control_app`) peers and the leader call, with the weight routes
  (`NodeWeights`: the model folders it was given, its shard stores, fetching its shard),
- `NodeWorker` (this node's rank process for the current epoch),
- `Leader` (formation, while this node leads), its `ClusterModel` (which model, whose weights
  move where) and its `Dispatcher` (the request source),
- the public API (`exo_tp.api`), which sees this class as its `Backend`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web
from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo_tp import __version__
from exo_tp.api.defaults import GenerationDefaults
from exo_tp.api.errors import FORWARD_PREFIX, ApiError
from exo_tp.api.routes import build_public_app
from exo_tp.api.views import plan_view
from exo_tp.errors import ExoTpError
from exo_tp.node.announcement import Announcement
from exo_tp.node.cluster_model import ClusterModel, Prepared, weights_url
from exo_tp.node.config import NodeConfig
from exo_tp.node.control import (
    Accepted,
    Assign,
    ControlClient,
    ControlRefused,
    NodeStatus,
    Ports,
    PortsRequest,
    Release,
    Released,
    control_app,
)
from exo_tp.node.dispatch import Dispatcher
from exo_tp.node.formation import Leader
from exo_tp.node.listeners import Listeners, guard_cluster_app, mount_forwarded_api
from exo_tp.node.memory import memory_now
from exo_tp.node.peers import Peers
from exo_tp.node.weights import NodeWeights
from exo_tp.node.worker import NodeWorker
from exo_tp.plan.devices import ProfileSummary
from exo_tp.security.signing import control_headers
from exo_tp.transport.ports import free_ports
from exo_tp.weights.server import MOUNT
from exo_tp.wire.runtime import Delta, Done, GenerateRequest

log = logging.getLogger(__name__)


class Node:
    def __init__(
        self, config: NodeConfig, weights: NodeWeights, profile: ProfileSummary | None = None
    ):
        self.config = config
        self.weights = weights
        self.profile = profile
        self.started = time.time()
        self.epoch_seen = 0
        self.control = ControlClient(config.secret)
        self.worker = NodeWorker(config.secret, config.stall_timeout)
        self.dispatcher = Dispatcher(
            config.secret.encode(),
            config.listen_host,
            config.serving.max_concurrency,
            config.max_queue,
        )
        self.peers: Peers | None = None
        self.leader: Leader | None = None
        self.models: ClusterModel | None = None
        self._loading: asyncio.Task[None] | None = None  # fetch, then start the worker
        self._assigned_key: str | None = None  # the model of the latest assignment
        self.listeners = Listeners()  # the public API's and the cluster's, apart
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self, public_routes: web.RouteTableDef) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3))
        control = control_app(
            self.config.secret, self._status, self._ports, self._assign, self._release
        )
        control.add_subapp(MOUNT, self.weights.app())
        api_limits, cluster_limits = self.config.api_limits, self.config.cluster_limits
        forwarded = build_public_app(
            self, web.RouteTableDef(), self.config.access, cluster_limits.body_timeout
        )
        mount_forwarded_api(control, forwarded)
        guard_cluster_app(control, cluster_limits)
        host = self.config.listen_host
        control_port = await self.listeners.serve_cluster(
            control, host, self.config.control_port, cluster_limits
        )
        requests_port = await self.dispatcher.start()
        await self.listeners.serve_api(
            build_public_app(self, public_routes, self.config.access, api_limits.body_timeout),
            host,
            self.config.api_port,
            api_limits,
            handler_cancellation=True,
        )
        me = self._announcement(control_port)
        self.peers = Peers(me, self.config.secret, self.config.host, self.control, self.status)
        await self.peers.start()
        self.models = ClusterModel(self.node_id, self.weights, self.peers, self.config.secret)
        self.leader = Leader(
            self.config,
            self.models,
            self.peers,
            self.control,
            self.dispatcher,
            requests_port,
            lambda: self.epoch_seen,
        )
        self._tasks = [
            asyncio.create_task(self._maintain(), name="maintain"),
            asyncio.create_task(self.leader.run_forever(), name="leader"),
        ]
        log.info(
            "node %s up: api %s, control port %d, cluster %r",
            self.node_id,
            me.api_url,
            control_port,
            self.config.cluster,
        )

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._stop_loading()
        await self.worker.close()
        await self.weights.close()
        self.dispatcher.stop()
        if self.peers is not None:
            await self.peers.stop()
        await self.listeners.close()
        await self.control.close()
        if self._session is not None:
            await self._session.close()

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
            memory_available=memory["available"] or 0,
            decode_seconds_per_byte=profile.decode_seconds_per_byte if profile else 0.0,
            prefill_flops=profile.prefill_flops if profile else 0.0,
            weight=self.config.weight,
            started=self.started,
        )

    async def _maintain(self) -> None:
        """Poll the peers every second; stop a worker whose leader is gone (it would spin in
        a dead ring)."""
        assert self.peers is not None
        while True:
            await self.peers.poll_once()
            leader = self.worker.assigned_by
            loading = self._loading is not None and not self._loading.done()
            if (
                (self.worker.rank is not None or loading)
                and leader != self.node_id
                and leader not in self.peers.alive_ids()
            ):
                log.warning(
                    "leader %s is gone; stopping worker of epoch %s", leader, self.worker.epoch
                )
                await self._stop_loading()
                await self.worker.replace(None)
            await asyncio.sleep(1.0 if len(self.peers.membership.members) > 1 else 0.5)

    # ---- the control server ---------------------------------------------------------------

    def status(self) -> NodeStatus:
        leader = self.leader
        leads = leader is not None and leader.leads() and leader.led is not None
        worker = self.worker
        return NodeStatus(
            node_id=self.node_id,
            leader=self.leader_id(),
            epoch=self.epoch_seen,
            worker_epoch=worker.epoch,
            worker_state=worker.state,
            worker_error=worker.error,
            worker_stalled=worker.stalled,
            profile=self.profile,
            weight=self.config.weight,
            cluster_state=leader.led.state if leads and leader.led else None,
            cluster_reason=leader.led.reason if leads and leader.led else None,
            backends=self.config.backends,
            rdma=self.config.rdma,
            memory=worker.machine_memory(),
            rank_memory=worker.rank_memory,
            links=worker.links,
            weights=self.weights.status(),
            speed=worker.speed,
        )

    async def _status(self) -> NodeStatus:
        return self.status()

    async def _ports(self, request: PortsRequest) -> Ports:
        ring, conductor, hop = free_ports(3, host=self.config.host)
        return Ports(ring=ring, conductor=conductor, hop=hop)

    async def _assign(self, body: Assign) -> Accepted:
        assignment = body.assignment
        if self.peers is None or body.leader != self.peers.leader_id():
            raise ControlRefused(f"{body.leader} is not my leader")
        if assignment.epoch <= self.epoch_seen and assignment.epoch != 0:
            raise ControlRefused("stale epoch")
        self.epoch_seen = max(self.epoch_seen, assignment.epoch)
        await self._stop_loading()
        order = body.weights
        self._assigned_key = order.key if order else None
        if order is None:  # every node loads assignment.model from its own files
            await self.worker.replace(assignment, body.leader)
        elif not order.needs_fetch:
            folder = self.weights.folder(order.key)
            if folder is None:
                raise ControlRefused(f"{self.node_id} has no files of {order.name}")
            await self.worker.replace(
                assignment.model_copy(update={"model_dir": str(folder)}), body.leader
            )
        else:  # fetch the shard first; the leader follows the fetch in this node's status
            await self.worker.replace(None)
            self.worker.assigned_by = body.leader
            self._loading = asyncio.create_task(
                self._fetch_then_start(body), name=f"weights-{assignment.epoch}"
            )
        return Accepted(accepted=assignment.epoch)

    def _weight_urls(self) -> dict[str, str]:
        assert self.peers is not None
        return {
            m.announcement.node_id: weights_url(m.announcement)
            for m in self.peers.membership.members.values()
        }

    async def _fetch_then_start(self, body: Assign) -> None:
        assert body.weights is not None
        assignment = body.assignment
        try:
            folder = await self.weights.receive(body.weights, assignment.epoch, self._weight_urls())
        except Exception as error:  # in the status: the leader fails the epoch, re-plans
            message = (
                str(error) if isinstance(error, ExoTpError) else f"{type(error).__name__}: {error}"
            )
            log.warning("epoch %d: %s", assignment.epoch, message)
            self.weights.failed(assignment.epoch, body.weights, message)
            return
        await self.worker.replace(
            assignment.model_copy(update={"model_dir": str(folder)}), body.leader
        )

    async def _stop_loading(self) -> None:
        task, self._loading = self._loading, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _release(self, body: Release) -> Released:
        epoch = self.worker.epoch
        if epoch is not None and epoch <= body.epoch:
            await self._stop_loading()
            await self.worker.replace(None)
        return Released(released=body.epoch)

    # ---- the public API's view of this node (exo_tp.api.backend.Backend) -----------------

    @property
    def node_id(self) -> str:
        return self.config.node_id

    def _prepared(self) -> Prepared:
        """The model this node serves requests for (as leader): the one it prepared last."""
        current = self.models.current if self.models else None
        if current is None:
            raise ApiError(
                503,
                "cluster not ready: no model loaded yet",
                kind="server_error",
                code="cluster_not_ready",
                retry_after=5,
            )
        return current

    @property
    def model(self) -> str:
        current = self.models.current if self.models else None
        return current.name if current else ""

    @property
    def tokenizer(self) -> TokenizerWrapper:
        return self._prepared().tokenizer

    @property
    def context_length(self) -> int:
        return self._prepared().spec.context_length

    @property
    def vocab_size(self) -> int:
        return self._prepared().spec.vocab_size

    @property
    def defaults(self) -> GenerationDefaults:
        return self.config.defaults

    def models_view(self) -> list[dict[str, Any]]:
        """/v1/models: every model a member has the files of (one at a time is served)."""
        if self.models is None:
            return []
        serving = self._serving_key()
        return [
            {
                "id": name,
                "object": "model",
                "created": int(self.started),
                "owned_by": "exo-tp",
                "loaded": key == serving,
            }
            for name, key in self.models.listing()
        ]

    def _serving_key(self) -> str | None:
        if self._leads():
            assert self.leader is not None
            return self.leader.led.model if self.leader.led else None
        return self._assigned_key

    def require_model(self, name: str) -> None:
        """A request for ``name`` (on the leader): 404 if no member has it; 503 while another
        listed model is served, which makes the leader load this one."""
        assert self.models is not None
        key = self.models.key_of(name)
        listing = self.models.listing()
        if key is None and not self.config.strict_model_names and len(listing) == 1:
            key = listing[0][1]  # one model: it serves any name, as mlx_lm.server does
        if key is None:
            listed = ", ".join(f"'{n}'" for n, _ in listing) or "none yet"
            raise ApiError(
                404,
                f"The model '{name}' does not exist; this cluster serves: {listed}.",
                param="model",
                code="model_not_found",
            )
        if key != self._serving_key():
            if self.models.wanted != key:
                log.info("a request asks for %s: loading it", name)
            self.models.wanted = key
            raise ApiError(
                503,
                f"loading the model '{name}' (the cluster serves one model at "
                f"a time); retry shortly",
                kind="server_error",
                code="model_loading",
                retry_after=10,
            )

    def leader_id(self) -> str | None:
        return self.peers.leader_id() if self.peers else None

    def _leads(self) -> bool:
        return self.leader is not None and self.leader.leads()

    def generation_url(self) -> str | None:
        if self._leads():
            return None
        leader = self.peers.get(self.peers.leader_id()) if self.peers else None
        if leader is None:
            raise ApiError(
                503, "cluster not ready: no leader", kind="server_error", code="cluster_not_ready"
            )
        return leader.control_url + FORWARD_PREFIX

    def forward_headers(self, path: str, body: bytes) -> dict[str, str]:
        return control_headers(self.config.secret, path, body)

    def generate(self, request: GenerateRequest) -> AsyncIterator[Delta | Done]:
        return self.dispatcher.generate(request)

    def _leader_status(self) -> NodeStatus | None:
        return self.peers.status(self.peers.leader_id()) if self.peers else None

    def health(self) -> dict[str, Any]:
        worker = self.worker
        stalled = worker.stalled is not None
        return {
            "status": "stalled" if stalled else "ok",
            "node_id": self.node_id,
            "state": self.serving_state(),
            "leader": self.leader_id(),
            "worker": {
                "epoch": worker.epoch,
                "state": worker.state,
                "stalled": worker.stalled,
                "error": worker.error,
            },
            "connections": self.listeners.view(),
        }

    def serving_state(self) -> str:
        if self._leads():
            assert self.leader is not None
            return self.leader.led.state if self.leader.led else "forming"
        status = self._leader_status()
        return status.cluster_state if status and status.cluster_state else "unknown"

    def state_reason(self) -> str:
        if self._leads():
            assert self.leader is not None
            if self.leader.led:
                return self.leader.led.reason
            return self.dispatcher.unavailable_reason
        status = self._leader_status()
        return status.cluster_reason or "" if status else ""

    async def plan_view(self) -> dict[str, Any]:
        assignment = self.worker.assignment
        if assignment is None:
            # A node the planner left out holds no rank but still shows the cluster's plan.
            leader = self.peers.get(self.peers.leader_id()) if self.peers else None
            if leader is not None and not self._leads() and self._session is not None:
                # over the leader's cluster listener: a flood of its public API cannot block it
                path = FORWARD_PREFIX + "/v1/plan"
                headers = {**self.config.access.auth_headers(), **self.forward_headers(path, b"")}
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                    async with self._session.get(
                        leader.control_url + path, headers=headers
                    ) as upstream:
                        view = await upstream.json()
                        if view.get("nodes"):
                            return view
            return {"epoch": None, "state": self.serving_state(), "plan": None, "nodes": []}
        return {
            "epoch": assignment.epoch,
            "state": self.serving_state(),
            "model": assignment.model,
            "nodes": list(assignment.nodes),
            **plan_view(assignment.plan, assignment.prediction),
            "balance": self.balance_view(),
        }

    def cluster_view(self) -> dict[str, Any]:
        assert self.peers is not None
        alive = set(self.peers.alive_ids())
        leader = self.peers.leader_id()
        serving = self._serving_key()
        nodes = []
        for node_id, member in sorted(self.peers.membership.members.items()):
            a = member.announcement
            status = self.peers.status(node_id)
            nodes.append(
                {
                    "node_id": node_id,
                    "host": a.host,
                    "api_url": a.api_url,
                    "alive": node_id in alive,
                    "leader": node_id == leader,
                    "weight": a.weight,
                    "memory_total": a.memory_total,
                    "memory_available": a.memory_available,
                    "decode_seconds_per_byte": a.decode_seconds_per_byte,
                    "prefill_flops": a.prefill_flops,
                    "version": a.version,
                    "worker_state": status.worker_state if status else None,
                    "worker_stalled": status.worker_stalled if status else None,
                    "profile": status.profile.model_dump(mode="json")
                    if status and status.profile
                    else {},
                    # live: total/available/used bytes of the machine, worker_rss of its worker
                    "memory": status.memory.model_dump() if status else None,
                    "weights": self._weights_view(status, serving),
                }
            )
        assignment = self.worker.assignment
        return {
            "cluster": self.config.cluster,
            "node_id": self.node_id,
            "leader": leader,
            "epoch": self.epoch_seen,
            "state": self.serving_state(),
            "state_reason": self.state_reason(),
            "model": self.models.view(serving) if self.models else None,
            "backend": assignment.backend if assignment else None,
            "nodes": nodes,
            "ranks": list(assignment.nodes) if assignment else [],
            "links": self._links_view(),
            "balance": self.balance_view(),
            "serving": {
                "max_concurrency": self.config.serving.max_concurrency,
                "in_flight": self.dispatcher.in_flight,
            },
        }

    def balance_view(self) -> dict[str, Any] | None:
        """Live rank speeds, shares and imbalance (the leader's; exo_tp.node.rebalance)."""
        return self.leader.balance.view(self.leader.led) if self._leads() and self.leader else None

    def _links_view(self) -> list[dict[str, Any]]:
        """Links measured by the workers of the current epoch (each once)."""
        assignment = self.worker.assignment
        if assignment is None or self.peers is None:
            return []
        links = {}
        for node_id in assignment.nodes:
            status = self.peers.status(node_id)
            if status is None or status.worker_epoch != assignment.epoch:
                continue
            for link in status.links:
                links[tuple(sorted((link.a, link.b)))] = link.model_dump(mode="json")
        return [links[k] for k in sorted(links)]

    @staticmethod
    def _weights_view(status: NodeStatus | None, key: str | None) -> dict[str, Any] | None:
        """What a node holds of the served model and its fetch (the UI's "weights" row), with
        its whole weights status (offers, recent fetches, bytes its server sent)."""
        if status is None:
            return None
        weights = status.weights
        offer = next((o for o in weights.offers if o.key == key), None)
        fetch = weights.fetch if weights.fetch and weights.fetch.key == key else None
        return {
            "holds": "files" if offer and offer.files else "store" if offer else None,
            "held_bytes": offer.held_bytes if offer else 0,
            "total_bytes": offer.total_bytes if offer else 0,
            "fetch": fetch.model_dump(mode="json") if fetch else None,
            "status": weights.model_dump(mode="json"),
        }
