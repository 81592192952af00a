"""Builds what a node shows: its status for its peers and its views for the public API
(/health, /v1/cluster, /v1/plan; the models are in exo_tp.node.cluster.views)."""

from __future__ import annotations

import contextlib
import time

import aiohttp
from pydantic import ValidationError

from exo_tp.api.core.errors import FORWARD_PREFIX
from exo_tp.frozen import replace
from exo_tp.node.cluster.config import NodeConfig
from exo_tp.node.cluster.control_messages import (
    MAIN_GROUP,
    GroupWorker,
    NodeStatus,
)
from exo_tp.node.cluster.finetune_messages import FineTunedModel
from exo_tp.node.cluster.views import (
    ClusterView,
    HealthView,
    ModelView,
    NodeView,
    PlanView,
    ServingState,
    ServingView,
    WorkerView,
    assignment_plan_view,
    links_of,
)
from exo_tp.node.finetune.ranks import FinetuneRanks
from exo_tp.node.group_views import group_views
from exo_tp.node.joined import Joined
from exo_tp.node.leader.dispatch import Dispatcher
from exo_tp.node.leader.keep_alive import KeepAliveView
from exo_tp.node.leader.links import measured_links
from exo_tp.node.listeners import Listeners
from exo_tp.node.member.control_handlers import ControlHandlers
from exo_tp.node.member.hub_downloads import HubDownloads
from exo_tp.node.member.link_probes import LinkProbes
from exo_tp.node.member.weights import NodeWeights
from exo_tp.node.member.worker import NodeWorker
from exo_tp.security.signing import control_headers
from exo_tp.wire.assignment import Assignment
from exo_tp.wire.balance import BalanceView
from exo_tp.wire.ids import NodeId
from exo_tp.wire.profiles import ProfileSummary


class StatusViews:
    def __init__(
        self,
        config: NodeConfig,
        profile: ProfileSummary | None,
        worker: NodeWorker,
        weights: NodeWeights,
        dispatcher: Dispatcher,
        handlers: ControlHandlers,
    ):
        self.config, self.profile = config, profile
        self.worker, self.weights, self.dispatcher = worker, weights, dispatcher
        self.handlers = handlers
        self.started = time.time()
        self.joined: Joined | None = None  # once the node announced itself
        self.session: aiohttp.ClientSession | None = None  # for the leader's plan
        self.listeners: Listeners | None = None  # set by the node once it listens
        self.downloads: HubDownloads | None = None  # set by the node
        self.finetune_ranks: FinetuneRanks | None = None  # set by the node
        self.probes: LinkProbes | None = None  # set by the node once it joined

    # ---- the cluster as this node sees it --------------------------------------------------

    def leader_id(self) -> NodeId | None:
        return self.joined.peers.leader_id() if self.joined else None

    def leads(self) -> bool:
        return self.joined is not None and self.joined.leads()

    def _leader_status(self) -> NodeStatus | None:
        peers = self.joined.peers if self.joined else None
        return peers.status(peers.leader_id()) if peers else None

    def serving_key(self) -> str | None:
        """The model key the cluster serves (as the leader formed it, else as assigned)."""
        if self.joined is not None and self.joined.leads():
            led = self.joined.leader.led
            return led.model if led else None
        return self.handlers.assigned_key

    def loaded_keys(self) -> frozenset[str]:
        """Every model a group of the cluster serves (or forms for): the leader's groups."""
        if self.joined is not None and self.joined.leads():
            groups = self.joined.groups
            held = (groups.key_of(leader) for leader in groups.leaders())
            return frozenset(k for k in held if k is not None)
        # Its own workers' models (a release clears them at once), and the groups it has no
        # rank of as the leader's last status said.
        me, status = self.config.node_id, self._leader_status()
        keys = set(self.handlers.assigned_keys.values())
        keys |= {g.key for g in status.groups if me not in g.ranks} if status else set()
        return frozenset(keys)

    def finetune_fine_tuned(self) -> tuple[FineTunedModel, ...]:
        return self.finetune_ranks.fine_tuned() if self.finetune_ranks else ()

    def serving_adapter(self) -> str | None:
        """The fine-tuning job whose adapter the served model carries (on the leader)."""
        if self.joined is not None and self.joined.leads():
            led = self.joined.leader.led
            return led.adapter_job if led else None
        return None

    def serving_state(self) -> ServingState:
        if self.joined is not None and self.joined.leads():
            led = self.joined.leader.led
            return led.state if led else "forming"
        status = self._leader_status()
        return status.cluster_state if status and status.cluster_state else "unknown"

    def state_reason(self) -> str:
        if self.joined is not None and self.joined.leads():
            led = self.joined.leader.led
            return led.reason if led else self.dispatcher.unavailable_reason
        status = self._leader_status()
        return status.cluster_reason or "" if status else ""

    # ---- for peers -------------------------------------------------------------------------

    def node_status(self) -> NodeStatus:
        led = self.joined.leader.led if self.joined and self.joined.leads() else None
        worker = self.worker
        return NodeStatus(
            node_id=self.config.node_id,
            leader=self.leader_id(),
            epoch=self.handlers.epoch_seen,
            worker_epoch=worker.epoch,
            worker_state=worker.state,
            worker_error=worker.error,
            worker_stalled=worker.stalled,
            profile=self.profile,
            weight=self.config.weight,
            cluster_state=led.state if led else None,
            cluster_reason=led.reason if led else None,
            backends=self.config.backends,
            rdma=self.config.rdma,
            memory=worker.machine_memory(),
            rank_memory=worker.rank_memory,
            links=worker.links,
            probes=self.probes.links() if self.probes else (),
            weights=self.weights.status(),
            speed=worker.speed,
            downloads=self.downloads.views() if self.downloads else (),
            finetune=self.finetune_ranks.status() if self.finetune_ranks else None,
            fine_tuned=self.finetune_ranks.fine_tuned() if self.finetune_ranks else (),
            # the leader's own view only: a follower's copy would echo it to every peer
            balance=self.balance() if self.leads() else None,
            workers=self._group_workers(),
            groups=self.joined.groups.views if self.joined and self.leads() else (),
        )

    def _group_workers(self) -> tuple[GroupWorker, ...]:
        """This node's workers of groups other than the main one."""
        handlers = self.handlers
        return tuple(
            GroupWorker(
                group=group,
                epoch=worker.epoch,
                state=worker.state,
                error=worker.error,
                stalled=worker.stalled,
                speed=worker.speed,
                links=worker.links,
                rank_memory=worker.rank_memory,
                model=handlers.assigned_keys.get(group),
            )
            for group, worker in handlers.workers.items()
            if group != MAIN_GROUP and (worker.rank is not None or worker.last_stall)
        )

    # ---- for the public API ----------------------------------------------------------------

    def health(self) -> HealthView:
        worker = self.worker
        return HealthView(
            status="stalled" if worker.stalled is not None else "ok",
            node_id=self.config.node_id,
            state=self.serving_state(),
            leader=self.leader_id(),
            worker=WorkerView(
                epoch=worker.epoch, state=worker.state, stalled=worker.stalled, error=worker.error
            ),
            connections=self.listeners.view() if self.listeners else {},
        )

    async def plan(self) -> PlanView:
        assignment = self.worker.assignment
        if assignment is not None:
            view = assignment_plan_view(assignment, self.serving_state())
            return replace(view, balance=self.balance())
        # A node the planner left out holds no rank but still shows the cluster's plan.
        upstream = await self._leader_plan()
        if upstream is not None and upstream.nodes:
            return upstream
        return PlanView(state=self.serving_state())

    async def _leader_plan(self) -> PlanView | None:
        peers = self.joined.peers if self.joined else None
        leader = peers.get(peers.leader_id()) if peers else None
        if leader is None or self.leads() or self.session is None:
            return None
        # over the leader's cluster listener: a flood of its public API cannot block it
        path = FORWARD_PREFIX + "/v1/plan"
        headers = {
            **self.config.access.auth_headers(),
            **control_headers(self.config.secret, path, b""),
        }
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError, ValidationError):
            async with self.session.get(leader.control_url + path, headers=headers) as upstream:
                return PlanView.model_validate(await upstream.json())
        return None

    def cluster(self) -> ClusterView:
        assert self.joined is not None
        peers = self.joined.peers
        alive = set(peers.alive_ids())
        leader = peers.leader_id()
        serving = self.serving_key()
        nodes = tuple(
            NodeView.of(
                member.announcement,
                peers.status(node_id),
                alive=node_id in alive,
                leader=node_id == leader,
                serving=serving,
            )
            for node_id, member in sorted(peers.membership.members.items())
        )
        assignment = self.worker.assignment
        return ClusterView(
            cluster=self.config.cluster,
            node_id=self.config.node_id,
            leader=leader,
            epoch=self.handlers.epoch_seen,
            state=self.serving_state(),
            state_reason=self.state_reason(),
            model=self._model_view(serving),
            backend=assignment.backend if assignment else None,
            nodes=nodes,
            ranks=assignment.nodes if assignment else (),
            links=links_of(assignment, {n: peers.status(n) for n in assignment.nodes})
            if assignment
            else (),
            measured_links=measured_links({n: peers.status(n) for n in peers.alive_ids()}),
            serving=ServingView(
                max_concurrency=self.config.serving.max_concurrency,
                in_flight=self.dispatcher.in_flight,
                drafted_tokens=self.dispatcher.drafted_tokens,
                accepted_tokens=self.dispatcher.accepted_tokens,
                draft_model=self.config.serving.draft_model,
                draft_node=_draft_node(assignment),
                mtp=self.config.serving.mtp,
                mtp_bytes=assignment.plan.spec.mtp_bytes if assignment else 0,
            ),
            balance=self.balance(),
            groups=group_views(self.joined, self._leader_status()),
        )

    def balance(self) -> BalanceView | None:
        """Live rank speeds, shares and imbalance (the leader's; exo_tp.node.leader.rebalance): a
        follower shows what the leader's last status said, so every node's page shows it."""
        if not self.leads() or self.joined is None:
            status = self._leader_status()
            return status.balance if status else None
        leader = self.joined.leader
        return leader.balance.view(leader.led)

    def _keep_alive(self, key: str) -> KeepAliveView | None:
        if self.joined is None or not self.leads() or key != self.serving_key():
            return None
        return self.joined.leader.keep_alive_view(key)

    def _model_view(self, key: str | None) -> ModelView | None:
        if key is None or self.joined is None:
            return None
        models = self.joined.models
        offers = models.offers()
        totals = [o.total_bytes for _, o in offers.get(key, []) if o.total_bytes]
        return ModelView(
            name=models.name_of(key, offers),
            key=key,
            total_bytes=max(totals, default=0),
            holders=tuple(sorted(n for n, _ in offers.get(key, []))),
            keep_alive=self._keep_alive(key),
        )


def _draft_node(assignment: Assignment | None) -> str | None:
    """The node that runs the draft model: the conductor's, where it is loaded."""
    if assignment is None or not assignment.serving.loads_draft():
        return None
    return assignment.nodes[assignment.conductor_rank] if assignment.nodes else None
