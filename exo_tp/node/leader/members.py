"""The eligible members as placement sees them: share weights (manual, or measured speeds for
the model), profiles, live slowdowns, memory and the links measured between them."""

from __future__ import annotations

import logging

from exo_tp.node.cluster.control_messages import MAIN_GROUP
from exo_tp.node.cluster.peers import Peers
from exo_tp.node.leader.links import measured_links
from exo_tp.node.leader.placement import Member, Members
from exo_tp.node.leader.rebalance import LiveBalance
from exo_tp.plan import ModelSpec
from exo_tp.plan.cluster import profile_read_speed
from exo_tp.wire.announcement import Announcement
from exo_tp.wire.ids import NodeId
from exo_tp.wire.profiles import ProfileSummary

log = logging.getLogger(__name__)


def node_weights(
    members: list[Announcement], profiles: dict[NodeId, ProfileSummary | None], spec: ModelSpec
) -> list[float]:
    """Share weight of each member: the manual weights if every member set one; else each
    member's decode speed (bytes/s) for ``spec`` from its profile summary (at the model's
    matrix shapes where it measured them, else its score for the model's weight format), or
    its announced headline score; a member with neither gets the others' mean speed."""
    if all(a.weight > 0 for a in members):
        return [a.weight for a in members]
    if any(a.weight > 0 for a in members):
        log.warning(
            "manual weights ignored: not every node set --weight (%s)",
            ", ".join(a.node_id for a in members if a.weight <= 0),
        )

    def speed(a: Announcement) -> float | None:
        profile = profiles.get(a.node_id)
        if profile is not None:
            return profile_read_speed(spec, profile)
        return 1.0 / a.decode_seconds_per_byte if a.decode_seconds_per_byte > 0 else None

    speeds = [speed(a) for a in members]
    known = [x for x in speeds if x is not None]
    fill = sum(known) / len(known) if known else 1.0
    return [fill if x is None else x for x in speeds]


def less_other_groups(eligible: list[Announcement], peers: Peers, group: str) -> list[Announcement]:
    """The members with the memory other groups' ranks hold on them (several models resident)
    taken from what they announced: what ``group``'s plan and KV budget may count on."""
    out = []
    for member in eligible:
        status = peers.status(member.node_id)
        held = 0
        if status is not None:
            others = [w.rank_memory for w in status.workers if w.group != group]
            if group != MAIN_GROUP:
                others.append(status.rank_memory)
            held = sum(m.active for m in others if m is not None)
        free = max(0, member.memory_available - held)
        out.append(member.model_copy(update={"memory_available": free}) if held else member)
    return out


def gather_members(
    spec: ModelSpec,
    eligible: list[Announcement],
    own_profile: ProfileSummary | None,
    peers: Peers,
    balance: LiveBalance,
    stages: tuple[int, ...],
) -> Members:
    """The eligible members as placement sees them (this node first, then by id): share
    weights from manual weights or measured speeds, live slowdowns, the links they
    measured to each other; forced stages from the config."""
    members = sorted(eligible, key=lambda a: (a.node_id != peers.me.node_id, a.node_id))
    profiles: dict[NodeId, ProfileSummary | None] = {}
    for a in members:
        status = peers.status(a.node_id)
        profiles[a.node_id] = (
            own_profile if a.node_id == peers.me.node_id else (status.profile if status else None)
        )
    weights = node_weights(members, profiles, spec)
    slowdowns = [1.0] * len(members)
    live = balance.live_weights([a.node_id for a in members])
    if live:  # rebalanced: the ranks' live speeds (on the profiles' scale)
        profiled = weights
        weights = [live.get(a.node_id, w) for a, w in zip(members, weights, strict=True)]
        # every read as much slower (or faster) as the rank now runs
        slowdowns = [p / w for p, w in zip(profiled, weights, strict=True)]
    measured = all(a.weight <= 0 and profiles[a.node_id] is not None for a in members)
    return Members(
        members=tuple(
            Member(
                node_id=a.node_id,
                weight=w,
                profile=profiles[a.node_id],
                slowdown=f,
                memory_available=a.memory_available,
            )
            for a, w, f in zip(members, weights, slowdowns, strict=True)
        ),
        measured=measured,  # weights are then decode speeds for the model's weight format
        stages=stages,
        links=measured_links({a.node_id: peers.status(a.node_id) for a in members}),
    )
