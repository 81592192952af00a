"""Who leads and who is alive (exo_tp.node.cluster.membership, pure logic with time passed in): the
rules that decide how fast a cluster recovers from its leader's death (issue #45)."""

from __future__ import annotations

from lab_profiles import lab_announcement

from exo_tp.node.cluster.membership import MISSED_PINGS_DEAD, SAME_START_S, Membership
from exo_tp.wire.announcement import Announcement
from exo_tp.wire.ids import NodeId

T0 = 1_700_000_000.0  # a unix time: when the cluster started


def _node(name: str, started: float) -> Announcement:
    return lab_announcement(name, started=started)


def test_a_cluster_started_together_is_led_by_its_smallest_id() -> None:
    view = Membership(_node("b", T0 + 1))
    view.upsert(_node("c", T0 + SAME_START_S * 0.9), now=1.0)
    view.upsert(_node("a", T0 + 3), now=1.0)
    assert view.leader_id() == "a"


def test_a_restarted_member_does_not_take_the_lead_back() -> None:
    """The old leader comes back (a newer start): the member that replaced it keeps leading,
    on every node's view alike, so the epoch it formed is not thrown away."""
    view = Membership(_node("b", T0))
    view.upsert(_node("a", T0), now=1.0)
    view.upsert(_node("c", T0), now=1.0)
    assert view.leader_id() == "a"
    view.ping_result(NodeId("a"), ok=False, now=2.0, refused=True)
    assert view.leader_id() == "b"
    view.upsert(_node("a", T0 + 60), now=8.0)  # restarted: a new announcement
    assert view.alive_ids() == ("a", "b", "c")
    assert view.leader_id() == "b"
    restarted = Membership(_node("a", T0 + 60))  # the restarted node's own view agrees
    restarted.upsert(_node("b", T0), now=8.0)
    restarted.upsert(_node("c", T0), now=8.0)
    assert restarted.leader_id() == "b"


def test_a_refused_connection_is_death_at_once_a_timeout_takes_missed_polls() -> None:
    view = Membership(_node("a", T0))
    view.upsert(_node("b", T0), now=1.0)
    view.upsert(_node("c", T0), now=1.0)
    for poll in range(MISSED_PINGS_DEAD - 1):
        assert not view.ping_result(NodeId("b"), ok=False, now=2.0 + poll)  # slow, or cut off
    assert "b" in view.alive_ids()
    assert view.ping_result(NodeId("b"), ok=False, now=5.0)
    assert view.ping_result(NodeId("c"), ok=False, now=5.0, refused=True)  # nothing listens
    assert view.alive_ids() == ("a",)


def test_the_leader_settles_after_joins_not_after_departures() -> None:
    view = Membership(_node("a", T0))
    view.upsert(_node("b", T0), now=1.0)
    view.upsert(_node("c", T0), now=2.0)
    assert (view.joined_at, view.changed_at) == (2.0, 2.0)
    view.ping_result(NodeId("c"), ok=False, now=7.0, refused=True)
    assert (view.joined_at, view.changed_at) == (2.0, 7.0)
    view.ping_result(NodeId("c"), ok=True, now=9.0)  # back: a join again
    assert (view.joined_at, view.changed_at) == (9.0, 9.0)
