"""A node cluster plans from its members' profiles: the planner leaves a 20x slower node out,
the others serve single-device mlx-lm's answer, and /v1/plan carries the prediction. The slow
node's headline score is as fast as the others': only the model's matrix shapes it measured
(`exo-tp bench --model`) say it is slow, so the leader must price by them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import http_json, local_cluster, wait_ready
from helpers import mlx_lm_reference
from lab_profiles import lab_profile
from node_views import cluster_view, plan_view

from exo_tp.plan.cost import bytes_per_weight
from exo_tp.plan.devices import MatmulScore
from exo_tp.plan.spec import load_spec
from exo_tp.profile.shapes import model_shapes
from exo_tp.wire.profiles import LinkProfile

pytestmark = pytest.mark.alone  # under pytest-xdist: measured profiles decide its plans

PROMPT = "What is the capital of France?"


def _shapes(model: Path, gb_per_s: float) -> tuple[MatmulScore, ...]:
    """Every shape the bench times for ``model``, each read at ``gb_per_s``."""
    spec = load_spec(model)
    dtype, shapes = model_shapes(spec)
    per = bytes_per_weight(spec)
    return tuple(
        MatmulScore(
            kind="matvec",
            dtype=dtype,
            m=1,
            k=k,
            n=n,
            seconds=k * n * per / (gb_per_s * 1e9),
            flops=2 * gb_per_s * 1e9 / per,
            weight_bytes_per_second=gb_per_s * 1e9,
        )
        for k, n in shapes
    )


def _profile(
    path: Path, gb_per_s: float, shapes: tuple[MatmulScore, ...] = (), **fields: Any
) -> Path:
    profile = lab_profile(gb_per_s, shapes=shapes, **fields)
    path.write_text(profile.model_dump_json())
    return path


def test_planner_leaves_a_slow_node_out(tmp_path: Path, default_models: dict[str, Path]) -> None:
    slow_shapes = _shapes(default_models["smollm2-135m"], 0.15)
    # The fast pair's link as `exo-tp bench --peers` measures loopback: without it the leader
    # plans with the links its nodes probe as they start, and on a loaded 2-core CI machine a
    # probe taken while three nodes import and load can price the pair's link above what the
    # split saves (CI planned one node once).
    loopback = LinkProfile(
        a="local-0", b="local-1", up=True, all_sum_latency=100e-6, all_sum_bandwidth=1e9
    )
    profiles = [
        _profile(tmp_path / "fast-a.json", 3.0, node_id="local-0", links=(loopback,)),
        _profile(tmp_path / "fast-b.json", 3.0, node_id="local-1"),
        _profile(tmp_path / "slow.json", 3.0, slow_shapes, node_id="local-2"),
    ]
    extra = ("--profiles", ",".join(map(str, profiles)))
    with local_cluster(3, ready=False, extra=extra) as cluster:
        wait_ready(cluster.urls, nodes=2)  # every node, the left-out one too, shows 2 ranks
        plan = plan_view(cluster.urls[2])
        assert plan.nodes == ("local-0", "local-1") and plan.plan is not None, plan
        assert plan.plan.weights == pytest.approx([0.5, 0.5])
        assert plan.predicted is not None and plan.predicted.tokens_per_second > 0
        view = cluster_view(cluster.urls[0])
        assert sorted(n.node_id for n in view.nodes) == ["local-0", "local-1", "local-2"]
        # The left-out node still answers, through the leader.
        code, answer = http_json(
            f"{cluster.urls[2]}/v1/chat/completions",
            {
                "model": "smollm2-135m",
                "max_tokens": 12,
                "temperature": 0,
                "messages": [{"role": "user", "content": PROMPT}],
            },
            timeout=120,
        )
        assert code == 200, json.dumps(answer)
    reference = mlx_lm_reference(default_models["smollm2-135m"], PROMPT, 12)
    assert answer["choices"][0]["message"]["content"] == reference.text
