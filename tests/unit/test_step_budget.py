"""A step's prompt chunk priced at its position (exo_tp.plan.step_budget): the budget is the
cost of so many tokens at position 0, and a chunk further on, attending to more cached tokens,
gets fewer (issue #60: a running stream's gap stays bounded through a long prefill)."""

from __future__ import annotations

import pytest

from exo_tp.plan import load_spec
from exo_tp.plan.cost import prefill_flops, rank_load
from exo_tp.plan.shard_plan import Span
from exo_tp.plan.step_budget import attention_ratio, chunk_at
from exo_tp.plan.tensor_parallel import plan_tensor_parallel


@pytest.mark.parametrize("ratio", [0.0005, 0.004, 0.05])
def test_a_chunk_costs_its_budget_wherever_it_starts(ratio: float) -> None:
    budget = 256.0
    assert chunk_at(budget, 0, 0.0) == 256
    previous = None
    for position in (0, 100, 1000, 8000, 30000):
        c = chunk_at(budget, position, ratio)
        cost = c * (1 + ratio * (position + c / 2))  # tokens at position 0
        assert cost <= budget < (c + 1) * (1 + ratio * (position + (c + 1) / 2))
        assert previous is None or c <= previous
        previous = c
    assert chunk_at(budget, 30000, ratio) < chunk_at(budget, 0, ratio)


def test_the_ratio_is_the_cost_models_quadratic_term(default_models: dict) -> None:
    """attention_ratio reproduces prefill_flops: a prompt of t tokens costs what t chunks of
    one token, each priced at its position, cost."""
    spec = load_spec(default_models["smollm2-135m"])
    ratio = attention_ratio(spec)
    assert 0 < ratio < 0.01
    whole = plan_tensor_parallel(spec, [1.0]).ranks[0]
    load = rank_load(spec, whole, Span(start=0, stop=spec.num_layers), True, True)
    tokens = 4000
    priced = sum(1 + ratio * (p + 0.5) for p in range(tokens)) * load.flops_per_token
    assert priced == pytest.approx(prefill_flops(load, tokens), rel=1e-3)
