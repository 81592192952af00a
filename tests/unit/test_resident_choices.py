"""The pure choices behind several models resident and replicas (issue #59): which models go
for a new one (least recently used, unpinned, memory and count), how the nodes split into
replicas, and which replica a request goes to."""

from __future__ import annotations

from exo_tp.node.leader.group_slots import Resident, split_nodes, to_evict
from exo_tp.node.leader.router import MIN_SHARED, Candidate, Router, choose, shared_prefix
from exo_tp.wire.ids import NodeId

GB = 10**9


def _model(key: str, last: float, size: int = GB, pinned: bool = False) -> Resident:
    return Resident(key=key, pinned=pinned, last_active=last, bytes=size)


def test_nothing_goes_while_the_new_model_fits() -> None:
    held = [_model("a", 1), _model("b", 2)]
    assert to_evict(held, needed=GB, free=2 * GB, max_models=3) == ()


def test_the_least_recently_used_unpinned_model_goes_first() -> None:
    held = [_model("pinned", 0, pinned=True), _model("old", 1), _model("new", 5)]
    assert to_evict(held, needed=GB, free=10 * GB, max_models=3) == ("old",)
    # memory: two must go to free 2 GB
    assert to_evict(held, needed=2 * GB, free=0, max_models=9) == ("old", "new")


def test_pinned_models_never_go_and_a_model_too_big_is_refused() -> None:
    held = [_model("pinned", 0, pinned=True), _model("b", 1)]
    assert to_evict(held, needed=3 * GB, free=GB, max_models=9) is None
    assert to_evict([_model("p", 0, pinned=True)], needed=GB, free=9 * GB, max_models=1) is None


def test_replicas_split_the_nodes_by_share_weight() -> None:
    weights = {NodeId("a"): 4.0, NodeId("b"): 2.0, NodeId("c"): 1.0, NodeId("d"): 1.0}
    sets = split_nodes(weights, 2)
    assert sets == (frozenset({"a"}), frozenset({"b", "c", "d"}))
    assert split_nodes(weights, 9) == tuple(frozenset({n}) for n in ("a", "b", "c", "d"))
    assert split_nodes({NodeId("x"): 1.0, NodeId("y"): 1.0}, 2) == (
        frozenset({"x"}),
        frozenset({"y"}),
    )


def test_the_router_sends_a_conversation_back_unless_its_replica_is_much_busier() -> None:
    cold = Candidate(group="cold", load=0, capacity=8)
    warm = Candidate(group="warm", load=1, capacity=8, shared=MIN_SHARED + 10)
    assert choose([cold, warm]).group == "warm"  # one more request: within a quarter batch
    busy = warm.model_copy(update={"load": 3})
    assert choose([cold, busy]).group == "cold"  # two over the least loaded: too busy
    little = warm.model_copy(update={"shared": MIN_SHARED - 1})
    assert choose([cold, little]).group == "cold"  # a template's prefix is not a conversation
    assert choose([Candidate(group="x", load=2, capacity=8), cold]).group == "cold"


def test_the_router_remembers_the_prompts_each_replica_ran() -> None:
    router = Router()
    router.ran("r1", [1, 2, 3, 4])
    assert router.shared("r1", [1, 2, 3, 4, 5, 6]) == 4
    assert router.shared("r1", [1, 2, 9]) == 2
    assert router.shared("r2", [1, 2, 3]) == 0
    assert shared_prefix([1, 2], [1, 2]) == 2
