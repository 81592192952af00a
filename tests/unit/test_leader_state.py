"""The leader's state and its pure functions (exo_tp.node.leader.state, .decide), driven without
a process: members joining and leaving, ranks failing, a rebalance's re-plan, the leadership
moving, a fine-tuning job's pause. Each step checks the state and the effects the node must
carry out, as a reader of the leader's loop (formation.py) expects them."""

from __future__ import annotations

from pathlib import Path

import pytest

from exo_tp import __version__
from exo_tp.node.cluster.control_messages import NodeStatus
from exo_tp.node.leader.decide import (
    CONDUCTOR_GRACE,
    LOAD_TIMEOUT,
    Round,
    next_step,
    round_of,
    track,
)
from exo_tp.node.leader.keep_alive import expires_at, unload_due
from exo_tp.node.leader.links import LINK_WAIT
from exo_tp.node.leader.state import (
    AssignmentsSent,
    ClusterSeen,
    ConductorLost,
    Detach,
    EpochFailed,
    EpochPlanned,
    EpochReady,
    EpochStarted,
    FetchMoving,
    ForgetBalance,
    KeepAliveAsked,
    LeaderEvent,
    LeadershipLost,
    LeaderState,
    LetGo,
    ModelAsked,
    Observed,
    Paused,
    Quarantined,
    Release,
    Replanning,
    Resume,
    Resumed,
    SymptomSeen,
    Unloaded,
    effects,
    eligible,
    reduce,
)
from exo_tp.plan import load_spec, plan_tensor_parallel
from exo_tp.plan.pipeline import single_stage
from exo_tp.plan.profiles import LinkProfile
from exo_tp.wire.announcement import Announcement
from exo_tp.wire.ids import Epoch, NodeId

A, B, C = NodeId("a"), NodeId("b"), NodeId("c")
MODEL = "smollm2"


@pytest.fixture(scope="module")
def plan(default_models: dict[str, Path]):  # noqa: ANN201
    spec = load_spec(default_models["smollm2-135m"])
    return single_stage(plan_tensor_parallel(spec, [5, 3, 2]))


def apply(state: LeaderState, *events: LeaderEvent) -> tuple[LeaderState, list]:
    """The state after ``events``, and every effect they asked for."""
    done = []
    for event in events:
        before, state = state, reduce(state, event)
        done += effects(before, state, event)
    return state, done


def seen(nodes: tuple[NodeId, ...], **changes: object) -> Round:
    fields = {
        "nodes": nodes,
        "model": MODEL,
        "adapter_job": None,
        "settled": True,
        "agreed": True,
        "links_ready": True,
    }
    return Round.model_validate(fields | changes)


def ready_status(node: NodeId, epoch: int, **changes: object) -> NodeStatus:
    fields = {"node_id": node, "leader": A, "epoch": epoch, "worker_epoch": epoch}
    return NodeStatus.model_validate(fields | {"worker_state": "ready"} | changes)


def formed(plan, number: int = 1, nodes=(A, B, C), at: float = 0.0):  # noqa: ANN001, ANN201
    """A leader that formed epoch ``number`` over ``nodes`` (not ready yet)."""
    state, _ = apply(
        LeaderState(),
        EpochStarted(number=Epoch(number), members=nodes, model=MODEL, at=at),
        EpochPlanned(nodes=nodes, plan=plan),
        AssignmentsSent(at=at),
    )
    return state


def test_a_joining_cluster_waits_to_settle_and_agree_then_forms_and_becomes_ready(plan) -> None:
    state = LeaderState()
    assert next_step(state, seen((A, B), settled=False), 0.0) == "wait"  # more may join
    assert next_step(state, seen((A, B, C), agreed=False), 0.0) == "wait"  # two leaders?
    assert next_step(state, seen((A, B, C), links_ready=False), 0.0) == "wait"
    assert next_step(state, seen((A, B, C), model=None), 0.0) == "no_model"
    assert next_step(state, seen((A, B, C)), 0.0) == "form"
    state, done = apply(
        state, EpochStarted(number=Epoch(1), members=(A, B, C), model=MODEL, at=0.0)
    )
    assert done == [Replanning(epoch=Epoch(1))] and state.forming()
    state, done = apply(state, EpochPlanned(nodes=(A, B, C), plan=plan), AssignmentsSent(at=1.0))
    assert done == [] and state.epoch is not None and state.epoch.started == 1.0
    assert next_step(state, seen((A, B, C)), 2.0) == "track"
    loading = {n: ready_status(n, 1, worker_state="loading") for n in (A, B, C)}
    assert track(state.epoch, loading, 2.0, 30.0).ready is False
    statuses = {n: ready_status(n, 1) for n in (A, B, C)}
    tracked = track(state.epoch, statuses, 2.0, 30.0)
    assert tracked.ready and tracked.events == ()
    state, done = apply(state, EpochReady())
    assert done == [Resume()] and state.epoch.state == "ready" and state.failures == 0


def test_a_member_leaving_re_plans_at_once_and_a_dropped_member_lets_its_worker_go(plan) -> None:
    state, _ = apply(formed(plan), EpochReady())
    assert next_step(state, seen((A, B, C)), 5.0) == "track"
    assert next_step(state, seen((A, B)), 5.0) == "form"  # a departure does not settle
    two = single_stage(plan_tensor_parallel(plan.stages[0].tp.spec, [1, 1]))
    state, done = apply(
        state,
        EpochStarted(number=Epoch(2), members=(A, B), model=MODEL, at=6.0),
        EpochPlanned(nodes=(A, B), plan=two),
        AssignmentsSent(at=7.0),
    )
    assert done == [Replanning(epoch=Epoch(2)), Release(nodes=(C,), epoch=Epoch(1))]
    assert state.previous is not None and state.previous.number == 1


def test_a_killed_rank_fails_the_epoch_which_backs_off_before_forming_again(plan) -> None:
    state = formed(plan)
    statuses = {
        A: ready_status(A, 1),
        B: ready_status(B, 1, worker_state="exited", worker_error="killed by signal 9"),
        C: ready_status(C, 1, worker_state="exited", worker_error="connection lost"),
    }
    tracked = track(state.epoch, statuses, 3.0, 30.0)
    (failed,) = tracked.events
    assert isinstance(failed, EpochFailed) and "rank 1 on node b stopped" in failed.reason
    state, done = apply(state, failed)
    assert state.epoch.state == "failed" and state.epoch.reason == failed.reason
    assert done == [Detach(reason=failed.reason), ForgetBalance(), Resume()]
    assert (state.failures, state.retry_at) == (1, 4.0)  # 1 s of back-off
    assert next_step(state, seen((A, B, C)), 3.5) == "wait"
    assert next_step(state, seen((A, B, C)), 4.5) == "form"
    state, _ = apply(state, EpochFailed(reason="later", at=5.0))  # failed already: kept
    assert state.epoch.reason == failed.reason and state.failures == 1
    again = formed(plan, 2, at=6.0).model_copy(update={"failures": state.failures})
    again, _ = apply(again, EpochFailed(reason="again", at=6.0))
    assert (again.failures, again.retry_at) == (2, 8.0)  # 1, 2, 4 ... 30 s


def test_a_broken_link_waits_for_its_cause_and_a_frozen_worker_is_left_out(plan) -> None:
    state = formed(plan)
    statuses = {
        A: ready_status(A, 1),
        B: ready_status(B, 1),
        C: ready_status(C, 1, worker_state="exited", worker_error="connection lost"),
    }
    (symptom,) = track(state.epoch, statuses, 3.0, 30.0).events
    assert symptom == SymptomSeen(at=3.0)
    state, _ = apply(state, symptom)
    assert track(state.epoch, statuses, 3.0 + CONDUCTOR_GRACE / 2, 30.0).events == ()
    frozen = statuses | {B: ready_status(B, 1, worker_stalled="frozen", worker_error="froze")}
    quarantined, failed = track(state.epoch, frozen, 4.0, 30.0).events
    assert quarantined == Quarantined(node=B, at=4.0, until=4.0 + 120.0)
    assert isinstance(failed, EpochFailed) and failed.reason == "rank 1 on node b froze"
    state, _ = apply(state, quarantined, failed)
    assert eligible(state, (A, B, C), 100.0) == (A, C)
    assert eligible(state, (A, B, C), 125.0) == (A, B, C)
    late = track(state.epoch.model_copy(update={"state": "loading"}), statuses, 9.0, 30.0)
    assert isinstance(late.events[-1], EpochFailed)  # the symptom, after the grace


def test_a_lost_conductor_is_named_after_the_grace_and_loading_times_out(plan) -> None:
    state = formed(plan)
    state, _ = apply(state, ConductorLost(epoch=Epoch(2), at=1.0))  # another epoch's: ignored
    assert state.epoch.conductor_lost is None
    state, _ = apply(state, ConductorLost(epoch=Epoch(1), at=1.0))
    statuses = {n: ready_status(n, 1, worker_state="loading") for n in (A, B, C)}
    assert track(state.epoch, statuses, 1.0 + CONDUCTOR_GRACE / 2, 30.0).events == ()
    (failed,) = track(state.epoch, statuses, 2.0 + CONDUCTOR_GRACE, 30.0).events
    assert "conductor (rank 0 on node a" in failed.reason
    fresh = formed(plan, at=0.0)
    assert track(fresh.epoch, statuses, LOAD_TIMEOUT + 1, 30.0).overdue
    moving = {n: s for n, s in statuses.items()}
    fetch = {"epoch": 1, "key": "k", "name": MODEL, "state": "fetching"}
    fetch |= {"share_bytes": 1, "retained_bytes": 0, "planned_bytes": 1}
    moving[A] = ready_status(A, 1, worker_state="none", weights={"fetch": fetch})
    tracked = track(fresh.epoch, moving, LOAD_TIMEOUT + 1, 30.0)
    assert tracked.events == (FetchMoving(at=LOAD_TIMEOUT + 1),) and not tracked.overdue


def test_the_leadership_moving_or_a_job_pausing_lets_the_epoch_go(plan) -> None:
    state, _ = apply(formed(plan), EpochReady())
    state, done = apply(state, LeadershipLost())
    assert state.epoch is None and done == [Detach(reason="leadership moved")]
    state, done = apply(state, LeadershipLost())
    assert done == []  # nothing led, nothing to stop
    state, _ = apply(formed(plan), EpochReady(), ModelAsked(key="other", adapter_job="job-1"))
    assert (state.wanted, state.wanted_adapter) == ("other", "job-1")
    state, done = apply(state, Paused(reason="fine-tuning job j"))
    assert done == [] and next_step(state, seen((A, B, C)), 9.0) == "wait"
    state, done = apply(state, LetGo(reason="fine-tuning job j"))
    assert state.epoch is None
    assert done == [
        Detach(reason="fine-tuning job j"),
        Resume(),
        Release(nodes=(A, B, C), epoch=Epoch(1)),
    ]
    state, _ = apply(state, Resumed())
    assert next_step(state, seen((A, B, C), model="other", adapter_job="job-1"), 9.0) == "form"


def test_an_idle_model_goes_after_its_keep_alive_and_a_request_brings_it_back(plan) -> None:
    """Ollama's keep_alive and --keep-alive (exo_tp.node.leader.keep_alive): a pinned model
    stays unless a request says otherwise; one loaded on demand goes after --keep-alive; a
    running or waiting request keeps any; idle counts from the last request's end."""
    state, _ = apply(formed(plan, at=0.0), EpochReady())
    pinned, other = frozenset({MODEL}), frozenset({"another"})
    assert expires_at(state, pinned, 60.0) is None  # pinned: for ever
    assert expires_at(state, other, None) is None  # no --keep-alive: for ever
    assert expires_at(state, other, 60.0) == 60.0  # on demand: 60 s after it started
    busy = ClusterSeen(in_flight=1, last_active=50.0)
    state, _ = apply(state, Observed(seen=busy, at=100.0))
    assert unload_due(state, other, 60.0, 200.0) is None  # a request runs
    idle = ClusterSeen(in_flight=0, last_active=130.0)  # it ended at 130
    state, _ = apply(state, Observed(seen=idle, at=131.0))
    assert expires_at(state, other, 60.0) == 190.0
    assert unload_due(state, other, 60.0, 189.0) is None
    assert "60 s idle" in (unload_due(state, other, 60.0, 190.0) or "")
    # a request's keep_alive overrides both, a pinned model's too (0: as soon as idle)
    state, _ = apply(state, KeepAliveAsked(seconds=0.0, at=140.0))
    assert unload_due(state, pinned, None, 140.0) is not None
    state, done = apply(state, Unloaded(reason="idle"))
    assert state.epoch is None and state.unloaded == "idle" and state.keep_for is None
    assert done == [Detach(reason="idle"), Resume(), Release(nodes=(A, B, C), epoch=Epoch(1))]
    state, _ = apply(state, ModelAsked(key=MODEL))
    assert state.unloaded is None and next_step(state, seen((A, B, C)), 150.0) == "form"
    state, _ = apply(state, KeepAliveAsked(seconds=-1.0, at=150.0))
    state, _ = apply(state, EpochStarted(number=Epoch(2), members=(A, B, C), model=MODEL, at=151))
    state, _ = apply(state, EpochReady())
    assert expires_at(state, other, 60.0) is None  # negative: for ever


def test_a_rebalance_forms_a_new_epoch_over_the_same_members(plan) -> None:
    state, _ = apply(formed(plan), EpochReady())
    uneven = single_stage(plan_tensor_parallel(plan.stages[0].tp.spec, [6, 3, 1]))
    state, done = apply(
        state,
        EpochStarted(number=Epoch(2), members=(A, B, C), model=MODEL, at=20.0),
        EpochPlanned(nodes=(A, B, C), plan=uneven),
        AssignmentsSent(at=21.0),
    )
    assert done == [Replanning(epoch=Epoch(2))]  # no member dropped: no release
    assert state.epoch.plan == uneven and state.previous.plan == plan


def member(node: NodeId) -> Announcement:
    return Announcement(
        node_id=node, version=__version__, cluster="t", host="127.0.0.1", api_port=1, control_port=2
    )


def observed(nodes, leader=A, probes=(), joined_at=0.0, stale=()):  # noqa: ANN001, ANN201
    """The state after a round saw ``nodes``, each naming ``leader`` (``stale``: not lately)."""
    statuses = {
        n: NodeStatus(node_id=n, leader=leader, epoch=0, probes=probes if n == A else ())
        for n in nodes
    }
    seen = ClusterSeen(
        members=tuple(member(n) for n in nodes),
        statuses=statuses,
        fresh=frozenset(n for n in nodes if n not in stale),
        joined_at=joined_at,
        changed_at=joined_at,
    )
    return reduce(LeaderState(), Observed(seen=seen))


def test_the_round_reads_members_statuses_and_links_from_the_state() -> None:
    link = [LinkProfile(a=A, b=B, up=True, all_sum_latency=1e-4)]
    state = observed((A, B), probes=link, joined_at=10.0)
    assert state.cluster.ids() == (A, B)

    def round_at(now: float, expected: int = 0, state: LeaderState = state) -> Round:
        return round_of(state, A, MODEL, None, 1.5, expected, now)

    assert not round_at(10.5).settled  # a member joined half a second ago: more may come
    assert round_at(10.5, expected=2).settled  # all the members asked for are here
    ready = round_at(12.0)
    assert ready.settled and ready.agreed and ready.links_ready and ready.nodes == (A, B)
    assert next_step(state, ready, 12.0) == "form"
    assert not round_at(12.0, state=observed((A, B), leader=B, probes=link)).agreed
    assert not round_at(12.0, state=observed((A, B), probes=link, stale=(B,))).agreed
    unmeasured = observed((A, B), joined_at=10.0)  # no probe of a-b yet
    assert not round_at(12.0, state=unmeasured).links_ready
    assert round_at(12.0, state=unmeasured).unmeasured == ((A, B),)  # what the log names
    assert round_at(11.5 + LINK_WAIT, state=unmeasured).links_ready  # then the default link
    left_out, _ = apply(state, Quarantined(node=B, at=0.0, until=20.0))
    assert round_at(12.0, state=left_out).nodes == (A,)
    three = observed((A, B, C), probes=link, joined_at=10.0)
    assert round_at(12.0, state=three).nodes == (A, B, C)  # a member joined: a new round plans it
