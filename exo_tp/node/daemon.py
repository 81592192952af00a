"""One exo-tp node: discovery, membership, leadership, its worker, and the HTTP servers.

Cluster formation (the leader; every node runs the same loop and acts only while it leads):
1. the alive membership has been stable for ``settle`` seconds and every member's last status
   names this node as leader (so two nodes never assign ranks at once);
2. plan the model over the members (shares from manual weights or measured decode speed:
   `node_weights`);
3. ask every member for free ports, build the ring hostfile, send each its Assignment (a new,
   higher epoch); each node replaces its worker;
4. when every worker reports ready, rank 0's worker (the leader's) starts taking requests.
A member that stops answering, a worker that exits, or a membership change starts a new epoch;
meanwhile requests get a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from exo_tp import __version__
from exo_tp.api.defaults import GenerationDefaults
from exo_tp.api.errors import ApiError
from exo_tp.api.routes import build_public_app
from exo_tp.api.views import plan_view
from exo_tp.errors import PlanError
from exo_tp.node.announcement import Announcement
from exo_tp.node.backend_choice import Requested, choose_backend
from exo_tp.node.conductor_link import ConductorLink, RequestChannel
from exo_tp.node.discovery import Discovery
from exo_tp.node.dispatcher import Dispatcher
from exo_tp.node.membership import Membership
from exo_tp.node.memory import memory_now
from exo_tp.node.planning import cluster_from_members
from exo_tp.node.security import control_headers, control_request_ok
from exo_tp.node.worker_handle import WorkerHandle
from exo_tp.plan import load_spec, plan_tensor_parallel
from exo_tp.plan.cost import weight_format
from exo_tp.plan.devices import LinkProfile, ProfileSummary
from exo_tp.plan.pipeline import PipelinePlan, plan_pipeline, single_stage
from exo_tp.plan.predict import Prediction
from exo_tp.plan.render import describe
from exo_tp.plan.render_choice import describe_candidate
from exo_tp.plan.search import choose_plan
from exo_tp.runtime.job import Assignment, DType
from exo_tp.runtime.messages import Delta, Done, GenerateRequest
from exo_tp.runtime.ports import free_ports

log = logging.getLogger(__name__)

POLL_SECONDS = 1.0
LOAD_TIMEOUT = 240.0
CONTROL_TIMEOUT = aiohttp.ClientTimeout(total=3)


@dataclass
class NodeConfig:
    node_id: str
    model: str
    host: str = "127.0.0.1"
    api_port: int = 8000
    control_port: int = 0  # 0: any free port (announced over mDNS)
    cluster: str = "exo-tp"
    secret: str = ""
    weight: float = 0.0  # manual share weight; 0: use the measured profile (see node_weights)
    dtype: DType = "float32"
    settle: float = 1.5
    bind: str = ""  # address the HTTP servers listen on (default: ``host``)
    backend: Requested = "auto"
    rdma: dict[str, str] = field(default_factory=dict)  # peer node id -> RDMA device
    backends: tuple[str, ...] = ("ring",)  # backends MLX can start on this node
    stages: tuple[int, ...] = ()  # leader: force pipeline stages (ranks per stage)
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)  # API defaults


@dataclass
class Epoch:
    """The leader's record of the cluster it formed."""

    number: int
    nodes: tuple[str, ...]  # node id per global rank
    plan: PipelinePlan
    members: tuple[str, ...] = ()  # every alive member it was formed for (some may be left out)
    prediction: Prediction | None = None  # the cost model's, when planned from profiles
    state: str = "loading"  # loading, ready, failed
    started: float = field(default_factory=time.monotonic)
    reason: str = ""
    backend: str = "ring"


def node_weights(members: list[Announcement], profiles: dict[str, ProfileSummary | None],
                 fmt: str) -> list[float]:
    """Share weight of each member: the manual weights if every member set one; else each
    member's decode speed (bytes/s) for the model's weight format, from its profile summary
    (or its announced headline score); a member with neither gets the others' mean speed.
    ``fmt``: the model's weight format (`exo_tp.plan.cost.weight_format`)."""
    if all(a.weight > 0 for a in members):
        return [a.weight for a in members]
    if any(a.weight > 0 for a in members):
        log.warning("manual weights ignored: not every node set --weight (%s)",
                    ", ".join(a.node_id for a in members if a.weight <= 0))

    def speed(a: Announcement) -> float | None:
        profile = profiles.get(a.node_id)
        if profile is not None:
            return profile.decode_speed_for(fmt)
        return 1.0 / a.decode_seconds_per_byte if a.decode_seconds_per_byte > 0 else None

    speeds = [speed(a) for a in members]
    known = [x for x in speeds if x is not None]
    fill = sum(known) / len(known) if known else 1.0
    return [fill if x is None else x for x in speeds]


def _summary(status: dict[str, Any]) -> ProfileSummary | None:
    """A peer's profile summary from its status; None if it has none (or an unreadable one)."""
    try:
        return ProfileSummary.model_validate(status["profile"]) if status.get("profile") else None
    except ValueError:  # pydantic's ValidationError: a peer of another version
        return None


class Node:
    def __init__(self, config: NodeConfig, model_dir: Path, tokenizer: Any,
                 profile: ProfileSummary | None = None):
        self.config = config
        self.model_dir = model_dir
        self.tokenizer = tokenizer
        self.spec = load_spec(model_dir)
        self.profile = profile
        self.started = time.time()
        self.membership: Membership | None = None
        self.statuses: dict[str, dict[str, Any]] = {}
        self.epoch_seen = 0
        self.assignment: Assignment | None = None
        self.assigned_by: str | None = None
        self.worker: WorkerHandle | None = None
        self.led: Epoch | None = None
        self.dispatcher = Dispatcher()
        self._runners: list[web.AppRunner] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self._discovery: Discovery | None = None
        self.conductor_link: ConductorLink | None = None
        self._requests = RequestChannel(config.secret, self._on_conductor,
                                        self._on_conductor_event, self._on_conductor_lost)
        self._requests_port = 0
        self._retry_at = 0.0  # no new epoch before this (after failures)
        self._failures = 0

    # ---- identity -------------------------------------------------------------------------

    def announcement(self, control_port: int) -> Announcement:
        memory = memory_now(None)  # at start; status polls report it live
        profile = self.profile
        return Announcement(
            node_id=self.config.node_id, version=__version__, cluster=self.config.cluster,
            host=self.config.host, api_port=self.config.api_port, control_port=control_port,
            memory_total=memory["total"] or 0, memory_available=memory["available"] or 0,
            decode_seconds_per_byte=profile.decode_seconds_per_byte if profile else 0.0,
            prefill_flops=profile.prefill_flops if profile else 0.0,
            weight=self.config.weight, started=self.started,
        )

    @property
    def me(self) -> str:
        return self.config.node_id

    # ---- the public API's view of this node (exo_tp.api.backend.Backend) -------------------

    @property
    def node_id(self) -> str:
        return self.config.node_id

    @property
    def model(self) -> str:
        return self.config.model

    @property
    def context_length(self) -> int:
        return self.spec.context_length

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def defaults(self) -> GenerationDefaults:
        return self.config.defaults

    def leader_id(self) -> str | None:
        return self.membership.leader_id() if self.membership else None

    def generation_url(self) -> str | None:
        if self.is_leader():
            return None
        leader = self.leader()
        if leader is None:
            raise ApiError(503, "cluster not ready: no leader", kind="server_error",
                           code="cluster_not_ready")
        return leader.api_url

    def generate(self, request: GenerateRequest) -> AsyncIterator[Delta | Done]:
        return self.dispatcher.generate(request)

    async def plan_view(self) -> dict[str, Any]:
        assignment = self.assignment
        if assignment is None:
            # A node the planner left out holds no rank but still shows the cluster's plan.
            leader = self.leader()
            if leader is not None and not self.is_leader():
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                    async with self._session.get(leader.api_url + "/v1/plan") as upstream:
                        view = await upstream.json()
                        if view.get("nodes"):
                            return view
            return {"epoch": None, "state": self.serving_state(), "plan": None, "nodes": []}
        return {"epoch": assignment.epoch, "state": self.serving_state(),
                "model": assignment.model, "nodes": list(assignment.nodes),
                **plan_view(assignment.plan, assignment.prediction)}

    def is_leader(self) -> bool:
        return self.membership is not None and self.membership.leader_id() == self.me

    def leader(self) -> Announcement | None:
        return self.membership.get(self.membership.leader_id()) if self.membership else None

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self, public_routes: web.RouteTableDef) -> None:
        self._session = aiohttp.ClientSession(timeout=CONTROL_TIMEOUT)
        control = web.Application()
        control.add_routes([
            web.get("/control/status", self._control_status),
            web.post("/control/ports", self._control_ports),
            web.post("/control/assign", self._control_assign),
            web.post("/control/release", self._control_release),
        ])
        control.middlewares.append(self._require_signature)
        control_port = await self._serve(control, self.config.control_port)
        self._requests_port = await self._requests.start(self.config.bind or self.config.host)
        await self._serve(build_public_app(self, public_routes), self.config.api_port,
                          handler_cancellation=True)
        me = self.announcement(control_port)
        self.membership = Membership(me)
        self._discovery = Discovery(me, self.config.secret, self.config.host,
                                    self._on_peer, self._on_gone)
        await self._discovery.start()
        self._tasks += [asyncio.create_task(self._poll_loop()),
                        asyncio.create_task(self._leader_loop())]
        log.info("node %s up: api %s, control port %d, cluster %r", self.me, me.api_url,
                 control_port, self.config.cluster)

    async def _serve(self, app: web.Application, port: int, **kwargs: Any) -> int:
        runner = web.AppRunner(app, access_log=None, **kwargs)
        await runner.setup()
        site = web.TCPSite(runner, self.config.bind or self.config.host, port)
        await site.start()
        self._runners.append(runner)
        return runner.addresses[0][1]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.worker is not None:
            await self.worker.stop()
        await self._requests.stop()
        if self._discovery is not None:
            await self._discovery.stop()
        for runner in self._runners:
            await runner.cleanup()
        if self._session is not None:
            await self._session.close()

    # ---- membership -----------------------------------------------------------------------

    def _on_peer(self, announcement: Announcement) -> None:
        assert self.membership is not None
        if self.membership.upsert(announcement, time.monotonic()):
            log.info("peer %s joined (%s)", announcement.node_id, announcement.api_url)

    def _on_gone(self, node_id: str) -> None:
        assert self.membership is not None
        if self.membership.remove(node_id, time.monotonic()):
            log.info("peer %s left", node_id)

    async def _control(self, peer: Announcement, method: str, path: str,
                       payload: dict[str, Any] | None = None) -> dict[str, Any]:
        assert self._session is not None
        body = json.dumps(payload).encode() if payload is not None else b""
        headers = {"Content-Type": "application/json",
                   **control_headers(self.config.secret, path, body)}
        async with self._session.request(method, peer.control_url + path, data=body,
                                         headers=headers) as response:
            response.raise_for_status()
            return await response.json()

    async def _poll_loop(self) -> None:
        """Every second: ask each peer for its status (liveness + worker state)."""
        assert self.membership is not None
        while True:
            peers = [a for a in self.membership.alive() if a.node_id != self.me]
            known = [m.announcement for m in self.membership.members.values()
                     if m.announcement.node_id != self.me]
            results = await asyncio.gather(*(self._control(p, "GET", "/control/status")
                                             for p in known), return_exceptions=True)
            now = time.monotonic()
            for peer, result in zip(known, results, strict=True):
                ok = isinstance(result, dict)
                if ok:
                    self.statuses[peer.node_id] = {**result, "seen": now}
                if self.membership.ping_result(peer.node_id, ok, now) and not ok:
                    log.warning("peer %s stopped answering", peer.node_id)
            self.statuses[self.me] = {**self.status(), "seen": now}
            self._drop_orphaned_worker()
            await asyncio.sleep(POLL_SECONDS if peers else POLL_SECONDS / 2)

    def _drop_orphaned_worker(self) -> None:
        """A worker whose leader is gone would spin in a dead ring: stop it."""
        assert self.membership is not None
        if (self.worker is not None and self.assigned_by != self.me
                and self.assigned_by not in self.membership.alive_ids()):
            log.warning("leader %s is gone; stopping worker of epoch %d", self.assigned_by,
                        self.worker.epoch)
            asyncio.ensure_future(self._replace_worker(None))

    # ---- control API (signed) -------------------------------------------------------------

    @web.middleware
    async def _require_signature(self, request: web.Request, handler: Any) -> web.StreamResponse:
        body = await request.read()
        if not control_request_ok(self.config.secret, request.path, body, dict(request.headers)):
            return web.json_response({"error": "bad or missing signature"}, status=401)
        return await handler(request)

    def status(self) -> dict[str, Any]:
        worker = self.worker
        return {
            "node_id": self.me,
            "leader": self.membership.leader_id() if self.membership else None,
            "epoch": self.epoch_seen,
            "worker_epoch": worker.epoch if worker else None,
            "worker_state": worker.state if worker else "none",
            "worker_error": worker.error if worker else None,
            "profile": self.profile.model_dump(mode="json") if self.profile else None,
            "weight": self.config.weight,
            "cluster_state": self.led.state if self.led and self.is_leader() else None,
            "cluster_reason": self.led.reason if self.led and self.is_leader() else None,
            "backends": list(self.config.backends),
            "rdma": self.config.rdma,
            "memory": memory_now(worker.pid if worker else None),
            # the links its worker's group measured when it formed (LinkProfile, node ids)
            "links": worker.links if worker and worker.state == "ready" else [],
        }

    async def _control_status(self, request: web.Request) -> web.Response:
        return web.json_response(self.status())

    async def _control_ports(self, request: web.Request) -> web.Response:
        ring, conductor, hop = free_ports(3, host=self.config.host)
        return web.json_response({"ring": ring, "conductor": conductor, "hop": hop})

    async def _control_assign(self, request: web.Request) -> web.Response:
        payload = await request.json()
        assignment = Assignment.model_validate(payload["assignment"])
        leader = payload["leader"]
        if self.membership is None or leader != self.membership.leader_id():
            return web.json_response({"error": f"{leader} is not my leader"}, status=409)
        if assignment.epoch <= self.epoch_seen and assignment.epoch != 0:
            return web.json_response({"error": "stale epoch"}, status=409)
        self.assigned_by = leader
        await self._replace_worker(assignment)
        return web.json_response({"accepted": assignment.epoch})

    async def _control_release(self, request: web.Request) -> web.Response:
        epoch = (await request.json())["epoch"]
        if self.worker is not None and self.worker.epoch <= epoch:
            await self._replace_worker(None)
        return web.json_response({"released": epoch})

    async def _replace_worker(self, assignment: Assignment | None) -> None:
        old, self.worker = self.worker, None
        if old is not None:
            await old.stop()
        self.assignment = assignment
        if assignment is not None:
            self.epoch_seen = max(self.epoch_seen, assignment.epoch)
            self.worker = WorkerHandle(assignment, self._on_worker_event, self.config.secret)
            await self.worker.start()
            log.info("epoch %d: worker started as rank %d of %d", assignment.epoch,
                     assignment.rank, assignment.plan.size)

    def _on_worker_event(self, worker: WorkerHandle, event: dict[str, Any]) -> None:
        if worker is not self.worker:
            return
        if event["type"] in ("error", "exited"):
            log.warning("epoch %d worker: %s", worker.epoch, worker.error)
            if self.led is not None and self.led.number == worker.epoch:
                self._fail_epoch(f"rank {worker.assignment.rank} failed: {worker.error}")

    # ---- the conductor's request channel (leader) ----------------------------------------

    def _on_conductor(self, link: ConductorLink) -> None:
        if self.led is None or link.epoch != self.led.number:
            link.close()  # a conductor of an epoch this leader is not running
            return
        if self.conductor_link is not None:
            self.conductor_link.close()
        self.conductor_link = link

    def _on_conductor_event(self, link: ConductorLink, event: dict[str, Any]) -> None:
        if link is self.conductor_link:
            self.dispatcher.on_worker_event(event)

    def _on_conductor_lost(self, link: ConductorLink) -> None:
        if link is self.conductor_link:
            self.conductor_link = None
            if self.led is not None and self.led.number == link.epoch:
                self._fail_epoch("the conductor (last stage's first rank) went away")

    # ---- leadership -----------------------------------------------------------------------

    def _agreed(self, members: list[Announcement]) -> bool:
        now = time.monotonic()
        for member in members:
            status = self.statuses.get(member.node_id)
            if status is None or now - status["seen"] > 3 * POLL_SECONDS:
                return False
            if status["leader"] != self.me:
                return False
        return True

    def _fail_epoch(self, reason: str) -> None:
        if self.led is not None and self.led.state != "failed":
            log.warning("epoch %d failed: %s", self.led.number, reason)
            self.led.state, self.led.reason = "failed", reason
            # back off 1, 2, 4 ... 30 s so a persistent problem does not spin
            self._retry_at = time.monotonic() + min(30.0, 2.0 ** self._failures)
            self._failures += 1
        self.dispatcher.detach(reason)

    async def _leader_loop(self) -> None:
        assert self.membership is not None
        while True:
            await asyncio.sleep(0.2)
            try:
                await self._lead_once()
            except Exception:  # a failed round must not kill the loop; the next one retries
                log.exception("leader round failed")
                if self.led is not None:
                    self._fail_epoch("formation failed")
                await asyncio.sleep(1.0)

    async def _lead_once(self) -> None:
        assert self.membership is not None
        if not self.is_leader():
            if self.led is not None:
                self.dispatcher.detach("leadership moved")
                self.led = None
            return
        members = self.membership.alive()
        nodes = tuple(sorted(m.node_id for m in members))
        led = self.led
        if led is not None and led.members == nodes and led.state != "failed":
            self._track(led)
            return
        if time.monotonic() - self.membership.changed_at < self.config.settle:
            return
        if led is not None and led.members == nodes and time.monotonic() < self._retry_at:
            return
        if not self._agreed(members):
            return
        await self._form(members)

    def _track(self, led: Epoch) -> None:
        """Follow a forming epoch's workers until all are ready, or it fails."""
        states = []
        for node_id in led.nodes:
            status = self.status() if node_id == self.me else self.statuses.get(node_id, {})
            if status.get("worker_epoch") != led.number:
                states.append("pending")
                continue
            states.append(status.get("worker_state"))
            if status.get("worker_state") == "exited":
                self._fail_epoch(f"worker on {node_id} stopped: {status.get('worker_error')}")
                return
        if led.state == "loading":
            link = self.conductor_link
            if all(s == "ready" for s in states) and link and link.epoch == led.number:
                led.state, self._failures = "ready", 0
                self.dispatcher.attach(link)
                log.info("epoch %d ready: %d ranks", led.number, len(led.nodes))
            elif time.monotonic() - led.started > LOAD_TIMEOUT:
                self._fail_epoch(f"workers not ready after {LOAD_TIMEOUT:.0f}s: {states}")

    def _plan(self, members: list[Announcement]) -> tuple[PipelinePlan, list[Announcement],
                                                          Prediction | None]:
        """The plan for these members, the member holding each global rank, the prediction.

        Forced stages and manual weights plan as told; otherwise, when every member announced
        its measured scores, the planner chooses (and may leave slow members out).
        """
        members = sorted(members, key=lambda a: (a.node_id != self.me, a.node_id))
        profiles = {a.node_id: self.profile if a.node_id == self.me
                    else _summary(self.statuses.get(a.node_id, {})) for a in members}
        weights = node_weights(members, profiles, weight_format(self.spec))
        if self.config.stages and sum(self.config.stages) == len(members):
            groups, start = [], 0
            for size in self.config.stages:
                groups.append(weights[start:start + size])
                start += size
            return plan_pipeline(self.spec, groups), members, None
        measured = all(a.weight <= 0 and (profiles[a.node_id] is not None
                                          or a.decode_seconds_per_byte > 0) for a in members)
        if measured:  # weights are then decode speeds for the model's weight format
            choice = choose_plan(self.spec, cluster_from_members(members, weights))
            names = [m.node_id for m in members]
            log.info("planner: %s; runner-ups: %s", describe_candidate(choice.best, names),
                     "; ".join(f"{c.prediction.tokens_per_second:.3g} tok/s "
                               f"{describe_candidate(c, names)}" for c in choice.alternatives))
            chosen = [members[d] for d in choice.best.devices]
            return choice.best.plan, chosen, choice.best.prediction
        return single_stage(plan_tensor_parallel(self.spec, weights)), members, None

    async def _form(self, members: list[Announcement]) -> None:
        alive = tuple(sorted(m.node_id for m in members))
        plan, members, prediction = self._plan(members)
        nodes = tuple(m.node_id for m in members)
        number = max(self.epoch_seen, self.led.number if self.led else 0,
                     max((s.get("epoch", 0) for s in self.statuses.values()), default=0)) + 1
        previous = self.led
        self.led = Epoch(number=number, nodes=nodes, plan=plan, members=alive,
                         prediction=prediction)
        self.dispatcher.detach("the cluster is re-planning")
        try:
            backend = choose_backend(
                self.config.backend, nodes,
                {n: self.statuses.get(n, {}).get("backends", ["ring"]) for n in nodes},
                {n: self.statuses.get(n, {}).get("rdma", {}) for n in nodes})
        except PlanError as error:
            self._fail_epoch(str(error))
            return
        log.info("forming epoch %d over %s: %s; %s", number, list(nodes), describe(plan),
                 backend.reason)
        self.led.backend = backend.backend
        ports = await asyncio.gather(*(self._control(m, "POST", "/control/ports", {})
                                       for m in members))

        def at(rank: int, kind: str) -> str:
            return f"{members[rank].host}:{ports[rank][kind]}"

        ranks = range(len(members))
        hops = tuple(at(r, "hop") for r in ranks) if len(plan.stages) > 1 else ()
        for rank, member in enumerate(members):
            assignment = Assignment(
                epoch=number, model=self.config.model, plan=plan, rank=rank,
                hostfile=tuple(at(r, "ring") for r in ranks),
                conductor=at(plan.stages[-1].ranks[0], "conductor"),
                requests_at=f"{self.config.host}:{self._requests_port}", hops=hops,
                nodes=nodes, dtype=self.config.dtype, backend=backend.backend,
                ibv_devices=backend.ibv_devices, prediction=prediction)
            await self._control(member, "POST", "/control/assign",
                                {"assignment": assignment.model_dump(mode="json"),
                                 "leader": self.me})
        self.led.started = time.monotonic()
        if previous is not None:  # members dropped from the cluster let their workers go
            assert self.membership is not None
            for node_id in set(previous.nodes) - set(nodes):
                peer = self.membership.get(node_id)
                if peer is not None:
                    asyncio.ensure_future(self._release(peer, number - 1))

    async def _release(self, peer: Announcement, epoch: int) -> None:
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            await self._control(peer, "POST", "/control/release", {"epoch": epoch})

    # ---- views for the public API ---------------------------------------------------------

    def cluster_view(self) -> dict[str, Any]:
        assert self.membership is not None
        alive = set(self.membership.alive_ids())
        nodes = []
        for node_id, member in sorted(self.membership.members.items()):
            a = member.announcement
            status = self.statuses.get(node_id, {})
            nodes.append({
                "node_id": node_id, "host": a.host, "api_url": a.api_url,
                "alive": node_id in alive, "leader": node_id == self.membership.leader_id(),
                "weight": a.weight, "memory_total": a.memory_total,
                "memory_available": a.memory_available,
                "decode_seconds_per_byte": a.decode_seconds_per_byte,
                "prefill_flops": a.prefill_flops, "version": a.version,
                "worker_state": status.get("worker_state"),
                "profile": status.get("profile") or {},
                # live: total/available/used bytes of the machine, worker_rss of its worker
                "memory": status.get("memory"),
            })
        assignment = self.assignment
        return {
            "cluster": self.config.cluster, "node_id": self.me,
            "leader": self.membership.leader_id(), "epoch": self.epoch_seen,
            "state": self.serving_state(), "state_reason": self.state_reason(),
            "backend": assignment.backend if assignment else None, "nodes": nodes,
            "ranks": list(assignment.nodes) if assignment else [],
            "links": self.links_view(),
        }

    def links_view(self) -> list[dict[str, Any]]:
        """Links measured by the workers of the current epoch (each once, as LinkProfile)."""
        assignment = self.assignment
        if assignment is None:
            return []
        links: dict[tuple[str, str], dict[str, Any]] = {}
        for node_id in assignment.nodes:
            status = self.status() if node_id == self.me else self.statuses.get(node_id, {})
            if status.get("worker_epoch") != assignment.epoch:
                continue
            for raw in status.get("links") or []:
                try:
                    link = LinkProfile.model_validate(raw)
                except ValueError:  # a peer of another version
                    continue
                links[tuple(sorted((link.a, link.b)))] = link.model_dump(mode="json")
        return [links[k] for k in sorted(links)]

    def state_reason(self) -> str:
        if self.is_leader():
            return self.led.reason if self.led else "waiting for peers to settle"
        status = self.statuses.get(self.membership.leader_id(), {}) if self.membership else {}
        return str(status.get("cluster_reason") or "")

    def serving_state(self) -> str:
        if self.is_leader():
            if self.led is None:
                return "forming"
            return self.led.state
        status = self.statuses.get(self.membership.leader_id(), {}) if self.membership else {}
        return str(status.get("cluster_state") or "unknown")
