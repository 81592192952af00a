"""The rebalancing decision (exo_tp.plan.rebalance): pure, over simulated live speed samples."""

from __future__ import annotations

import random
from pathlib import Path

from exo_tp.plan import load_spec, plan_tensor_parallel
from exo_tp.plan.pipeline import single_stage
from exo_tp.plan.rebalance import (
    RebalancePolicy,
    RebalanceState,
    add_sample,
    balanced_weights,
    decide,
    imbalance,
    replan_gain,
)

PROBE = 2.0  # seconds between samples, as the ranks probe


def _run(policy: RebalancePolicy, shard_bytes: list[float], speed_at, seconds: float, seed: int):
    """Feed one sample per rank every PROBE seconds; the times a re-plan was due."""
    rng = random.Random(seed)
    state, due, now = RebalanceState(), [], 0.0
    while now < seconds:
        for rank, base in enumerate(speed_at(now)):
            state = add_sample(state, policy, rank, base * rng.uniform(0.95, 1.05))
        verdict = decide(state, policy, shard_bytes, now)
        state = verdict.state
        if verdict.replan:
            due.append(now)
        now += PROBE
    return due


def test_imbalance_is_the_slowest_ranks_cost_over_a_balanced_split() -> None:
    assert imbalance([1, 1], [1, 1]) == 0
    assert abs(imbalance([1, 1], [1, 0.5]) - 0.5) < 1e-12  # 2 s vs 4/3 s
    assert abs(imbalance([2, 1], [1, 0.5])) < 1e-12  # shares follow speeds
    weights = balanced_weights([2.0, 1.0], [5.0, 5.0])
    assert abs(sum(weights) - 10.0) < 1e-9 and abs(weights[0] / weights[1] - 2.0) < 1e-9


def test_jitter_of_five_percent_never_triggers() -> None:
    policy = RebalancePolicy()
    for seed in range(20):
        # balanced shares for speeds 1 : 0.4, speeds jittering +-5% around them for an hour
        assert _run(policy, [1.0, 0.4], lambda _: (1.0, 0.4), 3600, seed) == []
        assert _run(policy, [1.0, 1.0, 1.0], lambda _: (1.0, 1.0, 1.0), 3600, seed) == []


def test_a_sustained_change_triggers_once_after_the_sustain_period() -> None:
    policy = RebalancePolicy()

    def speeds(now: float) -> tuple[float, float]:
        return (1.0, 1.0) if now < 60 else (1.0, 0.4)  # rank 1's factor 1 -> 2.5 at 60 s

    due = _run(policy, [1.0, 1.0], speeds, 200, seed=1)
    assert due, "a 2.5x slower rank must trigger a re-plan"
    # an even split at speeds 1 : 0.4 is 0.75 over a balanced one: it must last 20 s (15 s
    # of re-plan cost / 0.75), counted from the third slow sample (the median of 5 flips)
    assert policy.sustain_for(0.75) == 20.0
    assert 60 + policy.sustain_for(0.8) <= due[0] <= 60 + 10 + policy.sustain_for(0.7)
    # the shares never follow in this simulation: later triggers respect the cooldown
    assert all(b - a >= policy.cooldown_seconds for a, b in zip(due, due[1:], strict=False))


def test_a_modest_slowdown_must_last_until_a_replan_repays_its_cost() -> None:
    """A rank 20% slow (another program on its core, a busy host) costs 0.125 over a balanced
    split: a re-plan (15 s of drain and reload) pays only if that lasts 120 s. A minute of it
    passes; ten minutes trigger a re-plan, 120 s in."""
    policy = RebalancePolicy()

    def episode(length: float):
        return lambda now: (1.0, 0.8) if 60 <= now < 60 + length else (1.0, 1.0)

    assert _run(policy, [1.0, 1.0], episode(60), 600, seed=3) == []
    due = _run(policy, [1.0, 1.0], episode(600), 700, seed=3)
    assert due, "ten minutes of it must trigger a re-plan"
    assert 60 + policy.sustain_for(0.14) <= due[0] <= 60 + 10 + policy.sustain_for(0.11)


def test_a_short_dip_does_not_trigger() -> None:
    policy = RebalancePolicy()

    def speeds(now: float) -> tuple[float, float]:
        return (1.0, 0.4) if 60 <= now < 64 else (1.0, 1.0)  # a 4 s dip (Xcode opened, closed)

    assert _run(policy, [1.0, 1.0], speeds, 300, seed=2) == []


def test_replan_gain_counts_what_a_split_can_reach(default_models: dict[str, Path]) -> None:
    """SmolLM2's 9 heads split 6/3 or 5/4: equal devices gain nothing from re-planning an
    even plan even though its bytes are 54/46; a 2.5x slower second device gains a lot."""
    spec = load_spec(default_models["smollm2-135m"])
    even = single_stage(plan_tensor_parallel(spec, [1.0, 1.0]))
    nodes = ["a", "b"]
    assert replan_gain(even, nodes, even, nodes, {"a": 1e9, "b": 1e9}) == 0
    slow = {"a": 1e9, "b": 0.4e9}
    follows = single_stage(plan_tensor_parallel(spec, [1.0, 0.4]))
    gain = replan_gain(even, nodes, follows, nodes, slow)
    assert gain is not None and gain > 0.4
    assert replan_gain(even, nodes, follows, nodes, {"a": 1e9}) is None
