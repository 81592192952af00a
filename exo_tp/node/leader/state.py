"""The leader's state, one frozen value, and the pure functions that change it.

Everything the leader decides from lives in `LeaderState`: the epoch it formed (`LedEpoch`:
members, model, plan, ranks, loading/ready/failed), the back-off after failures, the members
left out for a while (a frozen worker), the model a request asked for, and a fine-tuning job's
pause. An event (`LeaderEvent`) is applied by `reduce`, a pure function of the state, the event
and nothing else; what the rest of the node must do about a change (stop or resume serving,
forget the live balance, release workers) is computed by `effects` from the state before, the
state after and the event, and carried out in one place (`Leader._apply`). What the leader
sees of its cluster each round (members, their statuses, links) is read fresh from its peers
and passed in: `exo_tp.node.leader.decide` turns the state and that view into the next events.
Unit tests drive it without a process (tests/unit/test_leader_state.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from exo_tp.frozen import Frozen
from exo_tp.node.cluster.control_messages import EpochState, NodeStatus
from exo_tp.plan.pipeline import PipelinePlan
from exo_tp.plan.predict import Prediction
from exo_tp.wire.announcement import Announcement
from exo_tp.wire.ids import Epoch, NodeId

QUARANTINE_MIN = 60.0
MAX_BACKOFF = 30.0  # seconds between failing epochs at most (1, 2, 4 ... 30)


class LedEpoch(Frozen):
    """The leader's record of the cluster it formed."""

    number: Epoch
    nodes: tuple[NodeId, ...] = ()  # node id per global rank
    plan: PipelinePlan | None = None  # None until planned
    members: tuple[NodeId, ...] = ()  # every eligible member it was formed for
    model: str | None = None  # the key of the model it serves
    prediction: Prediction | None = None  # the cost model's, when planned from profiles
    state: EpochState = "loading"
    started: float  # monotonic: when it began, then when its last fetch moved bytes
    reason: str = ""
    conductor_lost: float | None = None  # monotonic time the conductor's link dropped
    adapter_job: str | None = None  # the fine-tuning job whose adapter every shard carries
    symptom_seen: float | None = None  # monotonic time a rank first exited on a broken link

    def conductor_rank(self) -> int | None:
        if self.plan is None or self.plan.stages[-1].ranks[0] >= len(self.nodes):
            return None
        return self.plan.stages[-1].ranks[0]


def rank_name(led: LedEpoch, node_id: NodeId) -> str:
    """ "rank 2 on node local-2" (several ranks on one node are all named)."""
    ranks = [str(r) for r, n in enumerate(led.nodes) if n == node_id]
    which = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(ranks)}"
    return f"{which} on node {node_id}"


class ClusterSeen(Frozen):
    """What the leader saw of its cluster at its latest round: the membership and every
    member's status (its profile, the links it measured, its worker, its fetch) from the peers'
    poll, and the load from the request source."""

    members: tuple[Announcement, ...] = ()  # the alive members, this node included
    statuses: dict[NodeId, NodeStatus] = {}  # each member's latest status
    fresh: frozenset[NodeId] = frozenset()  # members whose status is recent (3 polls)
    joined_at: float = 0.0  # monotonic: when the alive set last gained a member
    changed_at: float = 0.0  # monotonic: when the alive set last changed
    in_flight: int = 0  # requests generating on the epoch
    waiting: int = 0  # requests queued for it
    last_active: float = 0.0  # monotonic: when a request last started or ended

    def ids(self) -> tuple[NodeId, ...]:
        return tuple(sorted(m.node_id for m in self.members))


class LeaderState(Frozen):
    cluster: ClusterSeen = ClusterSeen()  # what its latest round saw
    epoch: LedEpoch | None = None
    previous: LedEpoch | None = None  # the epoch the current one replaced
    failures: int = 0  # epochs failed in a row
    retry_at: float = 0.0  # monotonic: no new epoch over the same members before this
    quarantine: dict[NodeId, float] = {}  # node id -> monotonic time it may serve again
    wanted: str | None = None  # the model key a request asked for last
    wanted_adapter: str | None = None  # and the fine-tuning job's adapter it named
    paused: str | None = None  # a fine-tuning job holds the cluster: no epoch forms
    # Why no model is loaded (its keep-alive ended, or a client unloaded it): no epoch forms
    # until a request names a model again.
    unloaded: str | None = None
    busy_at: float = 0.0  # monotonic: when the epoch last had requests (or started)
    # Seconds the served model stays loaded once idle, as the latest request asked (Ollama's
    # keep_alive; negative: for ever); None: the node's --keep-alive (exo_tp.node.leader.keep_alive)
    keep_for: float | None = None

    def forming(self) -> bool:
        return self.epoch is not None and self.epoch.state == "loading"


# ---- events ---------------------------------------------------------------------------------


class Observed(Frozen):
    """A round's view of the cluster (members joining or leaving, statuses, links measured,
    loads): the leader decides from it (exo_tp.node.leader.decide)."""

    kind: Literal["observed"] = "observed"
    seen: ClusterSeen
    at: float = 0.0  # monotonic: when it was seen


class ModelAsked(Frozen):
    kind: Literal["model_asked"] = "model_asked"
    key: str
    adapter_job: str | None = None


class KeepAliveAsked(Frozen):
    """A request asked the served model to stay loaded ``seconds`` once idle (0: unload it as
    soon as nothing runs; negative: for ever)."""

    kind: Literal["keep_alive_asked"] = "keep_alive_asked"
    seconds: float
    at: float


class Unloaded(Frozen):
    """The served model is let go (its keep-alive ended, or a client asked): every worker
    goes, and no epoch forms until a request names a model."""

    kind: Literal["unloaded"] = "unloaded"
    reason: str


class Paused(Frozen):
    kind: Literal["paused"] = "paused"
    reason: str


class Resumed(Frozen):
    kind: Literal["resumed"] = "resumed"


class LeadershipLost(Frozen):
    """Another member leads now: this node leads no epoch."""

    kind: Literal["leadership_lost"] = "leadership_lost"


class LetGo(Frozen):
    """A fine-tuning job takes the cluster: every worker goes, requests get ``reason``."""

    kind: Literal["let_go"] = "let_go"
    reason: str


class EpochStarted(Frozen):
    kind: Literal["epoch_started"] = "epoch_started"
    number: Epoch
    members: tuple[NodeId, ...]
    model: str
    adapter_job: str | None = None
    at: float


class EpochPlanned(Frozen):
    kind: Literal["epoch_planned"] = "epoch_planned"
    nodes: tuple[NodeId, ...]
    plan: PipelinePlan
    prediction: Prediction | None = None


class AssignmentsSent(Frozen):
    """Every member has its assignment: the load timeout counts from here."""

    kind: Literal["assignments_sent"] = "assignments_sent"
    at: float


class FetchMoving(Frozen):
    """A member's fetch of its shard moved bytes: the load timeout counts from here again."""

    kind: Literal["fetch_moving"] = "fetch_moving"
    at: float


class Quarantined(Frozen):
    """A member's worker froze: plan without it until ``until``."""

    kind: Literal["quarantined"] = "quarantined"
    node: NodeId
    at: float
    until: float


class SymptomSeen(Frozen):
    """A rank exited on a broken link: wait a little for the rank that broke it to be named."""

    kind: Literal["symptom_seen"] = "symptom_seen"
    at: float


class ConductorLost(Frozen):
    kind: Literal["conductor_lost"] = "conductor_lost"
    epoch: Epoch
    at: float


class EpochFailed(Frozen):
    kind: Literal["epoch_failed"] = "epoch_failed"
    reason: str
    at: float


class EpochReady(Frozen):
    """Every worker is ready and the conductor joined the dispatcher."""

    kind: Literal["epoch_ready"] = "epoch_ready"


LeaderEvent = Annotated[
    Observed
    | ModelAsked
    | KeepAliveAsked
    | Unloaded
    | Paused
    | Resumed
    | LeadershipLost
    | LetGo
    | EpochStarted
    | EpochPlanned
    | AssignmentsSent
    | FetchMoving
    | Quarantined
    | SymptomSeen
    | ConductorLost
    | EpochFailed
    | EpochReady,
    Field(discriminator="kind"),
]


def _epoch(leader: LeaderState, **changes: object) -> LeaderState:
    """``leader`` with these fields of its epoch changed (unchanged without an epoch)."""
    if leader.epoch is None:
        return leader
    return leader.model_copy(update={"epoch": leader.epoch.model_copy(update=changes)})


def reduce(state: LeaderState, event: LeaderEvent) -> LeaderState:
    """The state after ``event`` (pure)."""
    update: dict[str, object]
    if isinstance(event, Observed):
        busy = event.at if event.seen.in_flight or event.seen.waiting else 0.0
        update = {
            "cluster": event.seen,
            "busy_at": max(state.busy_at, busy, event.seen.last_active),
        }
    elif isinstance(event, ModelAsked):
        update = {"wanted": event.key, "wanted_adapter": event.adapter_job, "unloaded": None}
        if event.key != state.wanted:  # a request's keep_alive was for the model it named
            update["keep_for"] = None
    elif isinstance(event, KeepAliveAsked):
        update = {"keep_for": event.seconds, "busy_at": event.at}
    elif isinstance(event, Unloaded):
        update = {"epoch": None, "unloaded": event.reason, "keep_for": None}
    elif isinstance(event, Paused):
        update = {"paused": event.reason}
    elif isinstance(event, Resumed):
        update = {"paused": None}
    elif isinstance(event, LeadershipLost | LetGo):
        update = {"epoch": None}
    elif isinstance(event, EpochStarted):
        epoch = LedEpoch(
            number=event.number,
            members=event.members,
            model=event.model,
            adapter_job=event.adapter_job,
            started=event.at,
        )
        update = {"epoch": epoch, "previous": state.epoch, "busy_at": event.at}
    elif isinstance(event, EpochPlanned):
        return _epoch(state, nodes=event.nodes, plan=event.plan, prediction=event.prediction)
    elif isinstance(event, AssignmentsSent | FetchMoving):
        return _epoch(state, started=event.at)
    elif isinstance(event, SymptomSeen):
        return _epoch(state, symptom_seen=event.at)
    elif isinstance(event, ConductorLost):
        led = state.epoch
        if led is None or led.number != event.epoch or led.conductor_lost is not None:
            return state
        return _epoch(state, conductor_lost=event.at)
    elif isinstance(event, Quarantined):
        left = {n: t for n, t in state.quarantine.items() if t > event.at}
        update = {"quarantine": {**left, event.node: event.until}}
    elif isinstance(event, EpochFailed):
        return _failed(state, event)
    else:  # EpochReady
        return _epoch(state, state="ready").model_copy(update={"failures": 0})
    return state.model_copy(update=update)


def _failed(state: LeaderState, event: EpochFailed) -> LeaderState:
    """A failing epoch backs off 1, 2, 4 ... 30 s so that a persistent problem does not spin;
    one that failed already keeps its first reason."""
    if state.epoch is None or state.epoch.state == "failed":
        return state
    failed = _epoch(state, state="failed", reason=event.reason)
    backoff = min(MAX_BACKOFF, 2.0**state.failures)
    return failed.model_copy(
        update={"retry_at": event.at + backoff, "failures": state.failures + 1}
    )


def eligible(state: LeaderState, alive: tuple[NodeId, ...], now: float) -> tuple[NodeId, ...]:
    """The alive members not left out for a frozen worker."""
    return tuple(n for n in alive if state.quarantine.get(n, 0.0) <= now)


# ---- what the node does about a change -------------------------------------------------------


class Detach(Frozen):
    """Stop serving: requests get a 503 with ``reason``."""

    kind: Literal["detach"] = "detach"
    reason: str


class Replanning(Frozen):
    """A new epoch forms: requests wait for it (or get the 503 of a re-plan)."""

    kind: Literal["replanning"] = "replanning"
    epoch: Epoch


class Resume(Frozen):
    """Requests held for a planned re-plan go now (to the new epoch, or get the 503)."""

    kind: Literal["resume"] = "resume"


class ForgetBalance(Frozen):
    """A live re-plan in progress is void: its epoch failed."""

    kind: Literal["forget_balance"] = "forget_balance"


class Release(Frozen):
    """Let the workers of ``epoch`` go on these members (dropped from the cluster, or a job
    takes the cluster)."""

    kind: Literal["release"] = "release"
    nodes: tuple[NodeId, ...]
    epoch: Epoch


Effect = Detach | Replanning | Resume | ForgetBalance | Release


def effects(before: LeaderState, after: LeaderState, event: LeaderEvent) -> list[Effect]:
    """What the node must do about ``event`` taking ``before`` to ``after`` (pure)."""
    if isinstance(event, EpochFailed):
        # whether or not an epoch failed here: the dispatcher stops, held requests get the 503
        return [Detach(reason=event.reason), ForgetBalance(), Resume()]
    if isinstance(event, EpochReady) and after.epoch is not None and after.epoch.state == "ready":
        return [Resume()]
    if isinstance(event, EpochStarted):
        return [Replanning(epoch=event.number)]
    if isinstance(event, AssignmentsSent) and after.epoch is not None and after.previous:
        dropped = set(after.previous.nodes) - set(after.epoch.nodes)
        if dropped:  # members dropped from the cluster let their workers go
            return [Release(nodes=tuple(sorted(dropped)), epoch=Epoch(after.epoch.number - 1))]
    if isinstance(event, LetGo | Unloaded):
        let_go: list[Effect] = [Detach(reason=event.reason), Resume()]
        if before.epoch is not None:
            nodes = tuple(sorted(set(before.epoch.nodes)))
            let_go.append(Release(nodes=nodes, epoch=before.epoch.number))
        return let_go
    if isinstance(event, LeadershipLost) and before.epoch is not None:
        return [Detach(reason="leadership moved")]
    return []
