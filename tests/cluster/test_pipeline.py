"""Pipelines of tensor-parallel stages equal single-device mlx-lm (real processes), and the
pure pipeline planner."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import Reference, assert_logits_close, launch, mlx_lm_reference
from test_tp_exact import PROMPT, TINY, TOKENS
from tiny_models import write_tiny_model

from exo_tp.errors import PlanError
from exo_tp.plan import ModelSpec
from exo_tp.plan.pipeline import head_layers, plan_pipeline, split_layers


@pytest.fixture(scope="module")
def float_reference(default_models: dict[str, Path]) -> Reference:
    return mlx_lm_reference(default_models["smollm2-135m"], PROMPT, TOKENS)


def test_two_uneven_tp_stages_equal_single_device(
    tmp_path: Path, float_reference: Reference
) -> None:
    """2 stages x uneven TP: ranks 0,1 (0.7/0.3) hold the first layers, ranks 2,3 (0.4/0.6)
    the rest with the norm and the (tied) LM head."""
    ours = launch(
        tmp_path,
        "smollm2-135m",
        [0.7, 0.3, 0.4, 0.6],
        PROMPT,
        TOKENS,
        "--stages",
        "2,2",
        "--stage-layers",
        "17,13",
    )
    assert_logits_close(ours.logits, float_reference.logits)
    assert list(ours.report.tokens) == float_reference.tokens


def test_tp_stage_then_single_rank_stage_q4(
    tmp_path: Path, default_models: dict[str, Path]
) -> None:
    """SmolLM2's widths and head groups in 4-bit (groups of 64, as mlx-lm's converter makes
    them), two layers of its thirty: the 4-bit default model's own decoding is covered by
    test_tp_exact, and its 4-bit steps cost ~15x these on a CPU."""
    smollm2 = default_models["smollm2-135m"]
    config = {**json.loads((smollm2 / "config.json").read_text()), "num_hidden_layers": 2}
    folder = write_tiny_model(
        tmp_path / "q4", config, smollm2, quantize={"group_size": 64, "bits": 4}
    )
    reference = mlx_lm_reference(folder, PROMPT, TOKENS)
    ours = launch(tmp_path, folder, [0.6, 0.4, 1.0], PROMPT, TOKENS, "--stages", "2,1")
    assert list(ours.report.tokens) == reference.tokens


def test_pure_pipeline_with_untied_head(tmp_path: Path, default_models: dict[str, Path]) -> None:
    """Three single-rank stages; the untied LM head lives only on the last one."""
    folder = write_tiny_model(
        tmp_path / "qwen2", TINY["qwen2"], default_models["smollm2-135m"], mx.float32, seed=1
    )
    reference = mlx_lm_reference(folder, PROMPT, 16)
    ours = launch(tmp_path, folder, [1, 1, 1], PROMPT, 16, "--stages", "1,1,1")
    assert_logits_close(ours.logits, reference.logits)
    assert list(ours.report.tokens) == reference.tokens


SPEC = ModelSpec(
    model_type="llama",
    hidden_size=576,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    ffn_sizes={"ffn": 1536},
    vocab_size=49152,
    tie_word_embeddings=True,
)


def test_layers_follow_stage_speed() -> None:
    assert split_layers(30, [2, 1]) == (20, 10)
    assert split_layers(30, [1, 1, 1]) == (10, 10, 10)
    assert split_layers(3, [100, 1, 1]) == (1, 1, 1)  # every stage keeps a layer
    # the last stage's tied head, 49152 x 576, weighs as much as 8 layers of 3.54 M
    # parameters (attention 576 x (2 * 576 + 2 * 192), FFN 3 x 576 x 1536), for the third of
    # the tokens that are generated: 2.67 layers. So stage 2 (speed 0.5) with 8 layers takes
    # 2 * (8 + 2.67) = 21.3, stage 1 (speed 1) 22: one layer more either way is slower
    layer = 576 * (2 * 576 + 2 * 192) + 3 * 576 * 1536
    assert head_layers(SPEC, 1.0) == pytest.approx(49152 * 576 / layer, rel=1e-3)
    assert head_layers(SPEC) == pytest.approx(49152 * 576 / layer / 3, rel=1e-3)
    assert split_layers(30, [1, 1], 8.0) == (19, 11)
    assert split_layers(30, [1, 1], head_layers(SPEC)) == (16, 14)
    plan = plan_pipeline(SPEC, [[0.7, 0.3], [0.5]])
    assert [s.layers.size for s in plan.stages] == [22, 8]
    assert [s.ranks for s in plan.stages] == [(0, 1), (2,)]
    assert plan.locate(2) == (1, 0) and plan.locate(1) == (0, 1)


@pytest.mark.parametrize(
    ("weights", "layers"),
    [([[1], [1]], [31, 0]), ([[1], [1]], [10, 10]), ([[1], []], None), ([[1]] * 31, None)],
)
def test_impossible_pipelines_say_why(weights: list[list[float]], layers: list[int] | None) -> None:
    with pytest.raises(PlanError):
        plan_pipeline(SPEC, weights, layers)


def test_architectures_without_stage_support_are_refused() -> None:
    """gemma3 scales its embedding inside the model's forward pass: a later stage would scale
    the hidden state it receives again (the matrix measured logits off by ~20 when tried);
    refused instead of computed wrong."""
    gemma = SPEC.model_copy(update={"model_type": "gemma3_text"})
    with pytest.raises(PlanError, match="not supported for gemma3_text.*llama"):
        plan_pipeline(gemma, [[1], [1]])
    assert plan_pipeline(gemma, [[1, 2]]).size == 2  # one stage: plain tensor parallelism


def test_cluster_serves_a_hybrid_plan(tiny_smollm2: Path) -> None:
    """`exo-tp run --local-nodes 3 --stages 2,1`: the leader's stage runs the first layers, the
    last node the rest; requests reach that node's conductor over the leader's channel. Then
    concurrent requests joining mid-generation, overlapped (the default): both ranks of the
    tensor-parallel first stage take every lane's tokens a round late and stay in step. On
    SmolLM2's tokenizer and head groups with 4 tiny layers (exact for any weights)."""
    from cluster_helpers import local_cluster
    from node_views import plan_view
    from openai import OpenAI
    from test_serving import PROMPTS, concurrent_answers
    from test_serving import TOKENS as ANSWER_TOKENS

    question = "What is the capital of France?"
    reference = mlx_lm_reference(tiny_smollm2, question, 24).text
    references = {p: mlx_lm_reference(tiny_smollm2, p, ANSWER_TOKENS).text for p in PROMPTS}
    model = str(tiny_smollm2)
    with local_cluster(3, weights=[5, 3, 2], model=model, extra=("--stages", "2,1")) as cluster:
        plan = plan_view(cluster.urls[1])
        assert [s.ranks for s in plan.stages] == [(0, 1), (2,)]
        # Every stage keeps a layer: the last stage's tied head (49152 x 144) weighs as much as
        # ~32 of these layers (221 k parameters), ~10.7 for the third of the tokens generated,
        # so the speeds 8 : 2 leave it the fewest.
        assert [s.layers.stop - s.layers.start for s in plan.stages] == [3, 1]
        assert plan.stages[0].plan.weights == pytest.approx([5 / 8, 3 / 8])
        client = OpenAI(base_url=f"{cluster.urls[2]}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="default_model",
            temperature=0,
            max_tokens=24,
            messages=[{"role": "user", "content": question}],
        )
        assert reply.choices[0].message.content == reference
        assert concurrent_answers(cluster.urls[0]) == references  # through the leader
