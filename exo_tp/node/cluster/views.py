"""What a node shows about itself and its cluster on its public API: typed views (/health,
/v1/cluster, /v1/plan; built by exo_tp.node.status_views). Readers (the web UI, benches,
tests) parse the JSON back into these models, e.g.
``ClusterView.model_validate(response.json())``.
"""

from __future__ import annotations

from typing import Literal

from exo_tp.api.server_limits import ListenerStats
from exo_tp.arch import mode_reason
from exo_tp.frozen import Frozen
from exo_tp.models.hub import DownloadProgress
from exo_tp.node.cluster.control_messages import (
    GroupView,
    MachineMemory,
    NodeStatus,
    Stall,
    WorkerState,
)
from exo_tp.node.cluster.weight_orders import FetchSummary, WeightsStatus
from exo_tp.node.leader.keep_alive import KeepAliveView
from exo_tp.plan.pipeline import PipelinePlan, Stage
from exo_tp.plan.predict import Prediction
from exo_tp.plan.shard_plan import ShardPlan, Span
from exo_tp.wire.announcement import Announcement
from exo_tp.wire.assignment import Assignment
from exo_tp.wire.balance import BalanceView
from exo_tp.wire.ids import Epoch, NodeId
from exo_tp.wire.profiles import LinkProfile, ProfileSummary

# The cluster as requests see it: forming (no epoch yet), loading, ready or failed (the
# leader's epoch), unknown (a member that has not heard from its leader).
ServingState = Literal["forming", "loading", "ready", "failed", "unknown"]


# ---- /health -------------------------------------------------------------------------------


class WorkerView(Frozen):
    epoch: Epoch | None
    state: WorkerState
    stalled: Stall | None
    error: str | None


class HealthView(Frozen):
    status: Literal["ok", "stalled"]
    node_id: NodeId
    state: ServingState
    leader: str | None
    worker: WorkerView
    # per listener (api, cluster): open connections, refusals, header timeouts
    connections: dict[str, ListenerStats] = {}


# ---- /v1/plan ------------------------------------------------------------------------------


class StageView(Frozen):
    ranks: tuple[int, ...]
    layers: Span
    plan: ShardPlan  # the stage's tensor-parallel plan


class PredictedView(Frozen):
    """The cost model's prediction for the plan."""

    tokens_per_second: float
    decode_seconds_per_token: float
    prefill_seconds: float
    prompt_tokens: int
    context_tokens: int
    # The planner's objective, why, and every stream's tokens/s together at ``streams`` at
    # once with the stages overlapped (what a throughput plan is ranked by).
    objective: Literal["latency", "throughput"] = "latency"
    objective_reason: str = ""
    streams: int = 1
    loaded_tokens_per_second: float = 0.0

    @staticmethod
    def of(prediction: Prediction) -> PredictedView:
        return PredictedView(
            tokens_per_second=prediction.tokens_per_second,
            decode_seconds_per_token=prediction.decode_seconds,
            prefill_seconds=prediction.prefill_seconds,
            prompt_tokens=prediction.prompt_tokens,
            context_tokens=prediction.context_tokens,
            objective=prediction.objective,
            objective_reason=prediction.reason,
            streams=prediction.streams,
            loaded_tokens_per_second=prediction.loaded_tokens_per_second,
        )


class PlanView(Frozen):
    """The current epoch's plan: its stages and, with one stage (the common case), that
    tensor-parallel plan as ``plan``; ``predicted`` is null when shares were set by hand."""

    epoch: Epoch | None = None  # None: no epoch yet
    state: ServingState
    model: str | None = None
    nodes: tuple[str, ...] = ()  # node id per global rank
    stages: tuple[StageView, ...] = ()
    plan: ShardPlan | None = None
    predicted: PredictedView | None = None
    balance: BalanceView | None = None  # the leader's live rank speeds (rebalancing)
    # How the model can run (exo_tp.arch.mode_reason): tensor-parallel, pipeline stages only
    # (no tensor-parallel table) or whole on one node, and why.
    mode: str = ""
    mode_reason: str = ""

    def pipeline(self) -> PipelinePlan | None:
        """The plan itself (None before the first epoch)."""
        if not self.stages:
            return None
        stages = tuple(Stage(ranks=s.ranks, layers=s.layers, tp=s.plan) for s in self.stages)
        return PipelinePlan(spec=stages[0].tp.spec, stages=stages)


def plan_view(
    plan: PipelinePlan,
    prediction: Prediction | None,
    *,
    epoch: Epoch | None,
    state: ServingState,
    model: str | None,
    nodes: tuple[str, ...],
) -> PlanView:
    stages = tuple(StageView(ranks=s.ranks, layers=s.layers, plan=s.tp) for s in plan.stages)
    mode, why = mode_reason(plan.spec.model_type)
    return PlanView(
        mode=mode,
        mode_reason=why,
        epoch=epoch,
        state=state,
        model=model,
        nodes=nodes,
        stages=stages,
        plan=stages[0].plan if len(stages) == 1 else None,
        predicted=PredictedView.of(prediction) if prediction is not None else None,
    )


def assignment_plan_view(assignment: Assignment, state: ServingState) -> PlanView:
    return plan_view(
        assignment.plan,
        assignment.prediction,
        epoch=assignment.epoch,
        state=state,
        model=assignment.model,
        nodes=assignment.nodes,
    )


# ---- /v1/cluster ---------------------------------------------------------------------------


class NodeWeightsView(Frozen):
    """What a node holds of the served model and its fetch (the UI's "weights" row), with its
    whole weights status (offers, recent fetches, bytes its server sent)."""

    holds: Literal["files", "store"] | None
    held_bytes: int
    total_bytes: int
    fetch: FetchSummary | None
    status: WeightsStatus

    @staticmethod
    def of(weights: WeightsStatus, key: str | None) -> NodeWeightsView:
        offer = next((o for o in weights.offers if o.key == key), None)
        fetch = weights.fetch if weights.fetch and weights.fetch.key == key else None
        return NodeWeightsView(
            holds="files" if offer and offer.files else "store" if offer else None,
            held_bytes=offer.held_bytes if offer else 0,
            total_bytes=offer.total_bytes if offer else 0,
            fetch=fetch,
            status=weights,
        )


class NodeView(Frozen):
    node_id: NodeId
    host: str
    api_url: str
    alive: bool
    leader: bool
    weight: float
    memory_total: int
    memory_available: int
    decode_seconds_per_byte: float
    prefill_flops: float
    version: str
    worker_state: WorkerState | None  # None: no status from it yet
    worker_stalled: Stall | None
    profile: ProfileSummary | None
    # live: total/available/used bytes of the machine, worker_rss of its worker
    memory: MachineMemory | None
    weights: NodeWeightsView | None
    downloads: tuple[DownloadProgress, ...] = ()  # hub models it fetches (bytes and total)

    @staticmethod
    def of(
        a: Announcement,
        status: NodeStatus | None,
        *,
        alive: bool,
        leader: bool,
        serving: str | None,
    ) -> NodeView:
        """A member as announced, with its last status (``serving``: the served model's key)."""
        return NodeView(
            node_id=a.node_id,
            host=a.host,
            api_url=a.api_url,
            alive=alive,
            leader=leader,
            weight=a.weight,
            memory_total=a.memory_total,
            memory_available=a.memory_available,
            decode_seconds_per_byte=a.decode_seconds_per_byte,
            prefill_flops=a.prefill_flops,
            version=a.version,
            worker_state=status.worker_state if status else None,
            worker_stalled=status.worker_stalled if status else None,
            profile=status.profile if status else None,
            memory=status.memory if status else None,
            weights=NodeWeightsView.of(status.weights, serving) if status else None,
            downloads=status.downloads if status else (),
        )


class ModelView(Frozen):
    name: str
    key: str
    total_bytes: int
    holders: tuple[str, ...]  # members with its files
    # the leader's keep-alive of the model it serves (None on a follower, or none served)
    keep_alive: KeepAliveView | None = None


class ServingView(Frozen):
    max_concurrency: int
    in_flight: int
    # speculative decoding over the requests this node dispatched (the leader: all of them)
    # since it started: tokens drafted, and accepted by the model
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    # the node's --draft-model, and the node it runs on: the conductor's, where the epoch
    # loads it (None: no epoch yet, or a quantized KV cache, which never speculates)
    draft_model: str | None = None
    draft_node: str | None = None
    # --mtp (auto: on GPUs), and the served checkpoint's MTP heads, held whole by every rank
    # of the last stage (bytes as stored; 0: it has none, or no epoch yet)
    mtp: str = "auto"
    mtp_bytes: int = 0


class ClusterView(Frozen):
    cluster: str
    node_id: str  # the node that answered
    leader: str | None
    epoch: Epoch  # the highest epoch this node has seen
    state: ServingState
    state_reason: str
    model: ModelView | None
    backend: str | None
    nodes: tuple[NodeView, ...]
    ranks: tuple[str, ...]  # node id per global rank of this node's epoch
    links: tuple[LinkProfile, ...]  # measured by the workers of this node's epoch, each once
    # measured between the alive members (probes as they joined, profiles benched together):
    # what the leader plans with (exo_tp.node.leader.links)
    measured_links: tuple[LinkProfile, ...] = ()
    serving: ServingView
    balance: BalanceView | None = None  # the leader's live rank speeds (rebalancing)
    groups: tuple[GroupView, ...] = ()  # every group: the models resident, their replicas

    def node(self, node_id: str) -> NodeView:
        return next(n for n in self.nodes if n.node_id == node_id)


def links_of(
    assignment: Assignment, statuses: dict[str, NodeStatus | None]
) -> tuple[LinkProfile, ...]:
    """Links measured by the workers of ``assignment``'s epoch (each once)."""
    links: dict[tuple[str, ...], LinkProfile] = {}
    for node_id in assignment.nodes:
        status = statuses.get(node_id)
        if status is None or status.worker_epoch != assignment.epoch:
            continue
        for link in status.links:
            links[tuple(sorted((link.a, link.b)))] = link
    return tuple(links[k] for k in sorted(links))
