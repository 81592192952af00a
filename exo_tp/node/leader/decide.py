"""What the leader does next, decided from its state (exo_tp.node.leader.state), including what
its latest round saw of the cluster: pure functions, the time passed in."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from exo_tp.frozen import Frozen
from exo_tp.node.cluster.control_messages import NodeStatus
from exo_tp.node.leader.links import LINK_WAIT, measured_links, unmeasured_pairs
from exo_tp.node.leader.state import (
    QUARANTINE_MIN,
    EpochFailed,
    FetchMoving,
    LeaderEvent,
    LeaderState,
    LedEpoch,
    Quarantined,
    SymptomSeen,
    eligible,
    rank_name,
)
from exo_tp.wire.ids import NodeId

LOAD_TIMEOUT = 240.0
CONDUCTOR_GRACE = 4.0  # seconds to learn which rank broke the conductor's link, from statuses


class Round(Frozen):
    """What the leader sees at the start of a round."""

    nodes: tuple[NodeId, ...]  # the eligible members
    model: str | None  # the model key to serve over them
    adapter_job: str | None  # the fine-tuning job whose adapter it carries
    settled: bool  # the membership is complete, or joins stopped for the settle time
    agreed: bool  # every member names this node leader
    links_ready: bool  # every pair's link measured, or waited for long enough
    unmeasured: tuple[tuple[NodeId, NodeId], ...] = ()  # the pairs no link measured yet


def round_of(
    state: LeaderState,
    me: NodeId,
    model: str | None,
    adapter_job: str | None,
    settle: float,
    expected: int,
    now: float,
    allowed: frozenset[NodeId] | None = None,
) -> Round:
    """The round as the state's view of the cluster shows it to leader ``me``: the eligible
    members; settled once ``expected`` members (0: unknown) are there or no member joined for
    ``settle`` seconds; agreed when each names ``me`` leader in a recent status; links ready
    when each pair's link was measured, or LINK_WAIT after the settle (the missing pairs then
    planned with the default link). ``allowed``: the nodes this group may use (None: all)."""
    cluster = state.cluster
    every = eligible(state, cluster.ids(), now)
    nodes = every if allowed is None else tuple(n for n in every if n in allowed)
    statuses = cluster.statuses
    agreed = all(n in cluster.fresh and statuses[n].leader == me for n in nodes)
    missing = unmeasured_pairs(measured_links({n: statuses.get(n) for n in nodes}), nodes)
    waited = now - cluster.changed_at - settle
    return Round(
        nodes=nodes,
        model=model,
        adapter_job=adapter_job,
        settled=0 < expected <= len(every) or now - cluster.joined_at >= settle,
        agreed=bool(nodes) and agreed,
        links_ready=bool(nodes) and (not missing or waited >= LINK_WAIT),
        unmeasured=tuple(missing),
    )


Step = Literal["wait", "track", "form", "no_model"]


def next_step(state: LeaderState, seen: Round, now: float) -> Step:
    """``track``: follow the epoch (it serves what the round asks for); ``form``: a new epoch;
    ``no_model``: nothing to serve; ``wait``: not yet (paused, settling, backing off, members
    not agreeing on the leader, links unmeasured)."""
    if state.paused is not None:
        return "wait"
    led = state.epoch
    same = (
        led is not None
        and led.members == seen.nodes
        and led.model == seen.model
        and led.adapter_job == seen.adapter_job
    )
    if same and led is not None and led.state != "failed":
        return "track"
    if not seen.settled or (same and now < state.retry_at):
        return "wait"
    if not seen.nodes or not seen.agreed:
        return "wait"
    if seen.model is None:
        return "no_model"
    return "form" if seen.links_ready else "wait"


class Tracked(Frozen):
    """A round's reading of an epoch's workers: the events it brings; whether every worker of
    a loading epoch is ready (the leader then attaches the conductor, and the epoch is ready),
    else whether it is overdue (not ready LOAD_TIMEOUT after its last progress)."""

    events: tuple[LeaderEvent, ...] = ()
    ready: bool = False
    overdue: bool = False


def track(
    led: LedEpoch, statuses: Mapping[NodeId, NodeStatus | None], now: float, stall_timeout: float
) -> Tracked:
    """Follow an epoch's workers: ready once all are, failed when one exits or stalls, or
    when a node could not fetch its shard, or its workers are not ready in time."""
    events: list[LeaderEvent] = []
    failures: list[tuple[int, str]] = []  # (how telling, reason): the culprit first
    for node_id, status in statuses.items():
        fetch = status.weights.fetch if status else None
        if fetch is not None and fetch.epoch == led.number:
            if fetch.state == "failed":
                reason = f"{node_id} could not fetch its weights: {fetch.error}"
                return Tracked(events=(*events, EpochFailed(reason=reason, at=now)))
            if fetch.state == "fetching":  # the load timeout starts once bytes stop moving
                events.append(FetchMoving(at=now))
        if status is None or status.worker_epoch != led.number:
            continue
        who = rank_name(led, node_id)
        if status.worker_stalled is not None:
            if status.worker_stalled == "frozen":  # re-plan without it for a while
                until = now + max(QUARANTINE_MIN, 4 * stall_timeout)
                events.append(Quarantined(node=node_id, at=now, until=until))
            telling = 2 if status.worker_stalled == "frozen" else 0
            failures.append((telling, f"{who} {status.worker_error}"))
        elif status.worker_state == "exited":
            error = status.worker_error or "stopped"
            # a killed rank is the cause; its peers then exit on the broken link
            failures.append((3 if "signal" in error else 1, f"{who} stopped: {error}"))
    verdict = _verdict(led, failures, len(statuses), now)
    if verdict is not None or led.state != "loading":
        return Tracked(events=(*events, *(verdict or ())))
    ready = all(
        s is not None and s.worker_epoch == led.number and s.worker_state == "ready"
        for s in statuses.values()
    )
    started = now if any(isinstance(e, FetchMoving) for e in events) else led.started
    return Tracked(events=tuple(events), ready=ready, overdue=now - started > LOAD_TIMEOUT)


def _verdict(
    led: LedEpoch, failures: list[tuple[int, str]], members: int, now: float
) -> tuple[LeaderEvent, ...] | None:
    """The workers' failure, if any (or () while waiting for the cause to be named); None
    where nothing failed."""
    if failures:
        telling, reason = max(failures)
        # A rank that exited on a broken link is a symptom: the rank that broke it (killed,
        # frozen) usually reports a poll later, from another node. Name the cause when it
        # comes; fall back to the symptom after the grace.
        if telling == 1 and len(failures) < members:
            if led.symptom_seen is None:
                return (SymptomSeen(at=now),)
            if now - led.symptom_seen < CONDUCTOR_GRACE:
                return ()
        return (EpochFailed(reason=reason, at=now),)
    lost = led.conductor_lost
    if lost is not None and now - lost > CONDUCTOR_GRACE:
        conductor = led.conductor_rank()
        reason = (
            f"the conductor ({rank_name(led, led.nodes[conductor])}, the last stage's "
            f"first rank) lost its link to the leader; no rank reported why within "
            f"{CONDUCTOR_GRACE:g} s"
            if conductor is not None
            else "the conductor lost its link to the leader"
        )
        return (EpochFailed(reason=reason, at=now),)
    return None
