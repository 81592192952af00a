"""One group or replicas, and several models' groups on one cluster (pure, no MLX).

The references are the planner's own single-plan prices on each replica's devices alone
(`choose_plan`, tested in test_search.py) and sums of memory written out by hand: the layouts
must be the compositions they claim to be."""

from __future__ import annotations

import pytest
from test_search import SLOW, THUNDERBOLT, device
from test_search import SPEC as BIG

from exo_tp.errors import PlanError
from exo_tp.plan import ModelSpec
from exo_tp.plan.cluster import Cluster
from exo_tp.plan.groups import GroupModel, place_groups
from exo_tp.plan.render_groups import render_groups
from exo_tp.plan.replicas import choose_replicas, split_devices, sub_cluster
from exo_tp.plan.search import choose_plan

# test_search's 8B-class llama in 4-bit (~4.5 GB of weights) and devices; a 1B-class one.
SMALL = BIG.model_copy(
    update={"hidden_size": 2048, "num_layers": 16, "ffn_sizes": {"ffn": 8192}, "head_dim": 64}
)


def test_devices_split_into_replicas_of_about_equal_speed() -> None:
    cluster = Cluster(devices=(device("a", 100, 64), device("b", 60, 64), device("c", 40, 64)))
    assert split_devices(cluster, 1) == ((0, 1, 2),)
    assert split_devices(cluster, 2) == ((0,), (1, 2))  # 100 against 60 + 40
    assert split_devices(cluster, 3) == ((0,), (1,), (2,))


def test_latency_on_fast_links_keeps_one_group_over_every_device() -> None:
    cluster = Cluster(
        devices=(device("a", 100, 64), device("b", 100, 64), device("c", 100, 64)),
        default_link=THUNDERBOLT,
    )
    choice = choose_replicas(BIG, cluster, "latency", context_tokens=4096)
    assert len(choice.best.subsets) == 1 and choice.best.devices(0) == (0, 1, 2)
    alone = choose_plan(BIG, sub_cluster(cluster, (0,)), context_tokens=4096).best.prediction
    assert choice.best.decode_seconds < alone.decode_seconds  # what the group buys
    assert "one group" in choice.reason


def test_throughput_on_a_slow_link_takes_replicas_and_adds_their_speeds() -> None:
    cluster = Cluster(devices=(device("a", 100, 64), device("b", 100, 64)), default_link=SLOW)
    choice = choose_replicas(BIG, cluster, "throughput", queue=16, context_tokens=4096)
    best = choice.best
    assert best.subsets == ((0,), (1,)) and best.streams == (8, 8)
    one = choose_plan(BIG, sub_cluster(cluster, (0,)), 4096, objective="throughput", queue=16)
    at_eight = one.best.prediction.model_copy(update={"streams": 8}).loaded_tokens_per_second
    assert best.tokens_per_second == pytest.approx(2 * at_eight)
    single = next(o for o in choice.options if len(o.subsets) == 1)
    assert best.tokens_per_second > single.tokens_per_second
    assert "2 replicas" in choice.reason and "against" in choice.reason


def test_a_lone_request_goes_to_the_fastest_replica() -> None:
    cluster = Cluster(devices=(device("a", 100, 64), device("b", 25, 64)), default_link=SLOW)
    choice = choose_replicas(BIG, cluster, "latency", context_tokens=4096)
    replicas = next(o for o in choice.options if len(o.subsets) == 2)
    fast = choose_plan(BIG, sub_cluster(cluster, (0,)), 4096).best.prediction
    assert replicas.decode_seconds == pytest.approx(fast.decode_seconds)
    assert replicas.streams == (1, 0)  # the router's pick when both are idle


def test_replicas_that_cannot_hold_the_model_are_ruled_out_with_the_reason() -> None:
    # 3 GB each: the 4.5 GB model needs both devices' memory.
    cluster = Cluster(devices=(device("a", 100, 3), device("b", 100, 3)), default_link=SLOW)
    choice = choose_replicas(BIG, cluster, "throughput", queue=16, context_tokens=1024)
    assert [len(o.subsets) for o in choice.options] == [1]
    assert [count for count, _ in choice.rejected] == [2]
    assert "no plan fits" in choice.rejected[0][1]


def _models(cluster: Cluster, *specs: tuple[str, ModelSpec]) -> list[GroupModel]:
    return [
        GroupModel(key=key, spec=spec, cluster=cluster, pinned=True, context_tokens=2048)
        for key, spec in specs
    ]


def test_two_models_share_the_devices_whose_memory_holds_both() -> None:
    cluster = Cluster(
        devices=(device("a", 100, 6), device("b", 60, 6), device("c", 40, 6)),
        default_link=THUNDERBOLT,
    )
    plan = place_groups(_models(cluster, ("big", BIG), ("small", SMALL)))
    assert [g.key for g in plan.groups] == ["big", "small"]
    held: dict[int, int] = {}
    for group in plan.groups:
        for d, b in group.choice.best.memory().items():
            held[d] = held.get(d, 0) + b
    assert all(plan.left[d] == plan.memory[d] - held.get(d, 0) for d in range(3))
    assert all(b <= plan.memory[d] for d, b in held.items())
    # the second group was planned on what the first left: alone it would see 6 GB each
    big_alone = choose_replicas(BIG, cluster, context_tokens=2048).best.memory()
    assert plan.groups[0].choice.best.memory() == big_alone
    text = render_groups(plan, ["a", "b", "c"])
    assert "big (pinned)" in text and "small (pinned)" in text and "memory left" in text


def test_a_model_that_does_not_fit_beside_the_others_is_refused_with_its_size() -> None:
    cluster = Cluster(devices=(device("a", 100, 3), device("b", 100, 3)))
    with pytest.raises(
        PlanError,
        match=r"second does not fit beside the models resident: its "
        r"weights alone need \d\.\d+ GB; left: a .*, b ",
    ):
        place_groups(_models(cluster, ("first", BIG), ("second", BIG)))
