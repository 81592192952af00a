"""A leader's round deciding whether to re-plan the shares of a ready epoch from its ranks'
live speeds (exo_tp.node.leader.rebalance holds the balance; exo_tp.plan.rebalance the gain)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from exo_tp.node.leader.members import node_weights
from exo_tp.node.leader.placement import plan_of, serving_draft
from exo_tp.plan.rebalance import replan_gain
from exo_tp.wire.announcement import Announcement
from exo_tp.wire.ids import NodeId
from exo_tp.wire.profiles import ProfileSummary

if TYPE_CHECKING:
    from exo_tp.node.leader.formation import Leader
    from exo_tp.node.leader.state import LedEpoch


def consider_rebalance(leader: Leader, led: LedEpoch, members: list[Announcement]) -> bool:
    """Whether to hold new requests and re-plan now: the live speeds drifted for long enough,
    the shares were not set by hand, and the best split is worth it."""
    balance = leader.balance
    statuses = {n: leader.peers.status(n) for n in led.nodes}
    if not balance.observe(led, statuses, time.monotonic()):
        return False
    if any(m.weight > 0 for m in members):  # shares set by hand stay as they were set
        balance.skipped = "the shares were set by --weight"
        return False
    profiles: dict[NodeId, ProfileSummary | None] = {
        n: s.profile if s else None for n, s in statuses.items()
    }
    announced = [m for m in members if m.node_id in statuses]
    assert led.plan is not None
    spec = led.plan.stages[0].tp.spec
    weights = dict(
        zip([a.node_id for a in announced], node_weights(announced, profiles, spec), strict=True)
    )
    balance.begin(led, [m.node_id for m in members], weights)
    me = leader.peers.status(leader.me)
    eligible = leader.members_for(spec, members, me.profile if me else None)
    serving = leader.config.serving
    draft = serving_draft(serving)
    candidate, chosen, _, _ = plan_of(spec, eligible, serving.objective, leader.queue, draft)
    gain = replan_gain(led.plan, led.nodes, candidate, list(chosen), balance.speeds())
    if gain is not None and gain <= balance.policy.threshold / 2:
        balance.cancel(f"the best split is only {100 * gain:.0f}% faster")
        return False
    return True
