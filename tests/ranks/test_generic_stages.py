"""mlx-lm architectures without a tensor-parallel table (exo_tp.arch.generic): as pipeline
stages of whole layers with uneven layer shares, or, where their layer stack does not allow
stages, whole on one node; each against single-device mlx-lm on the same tiny checkpoint
(fp32 prompt logits within 1e-4, greedy tokens identical).

The stages run in this one process, chained as the runtime chains them (each stage loaded by
the engine's loader for its layer slice, a later stage fed the previous stage's hidden state
through its embedding's `HiddenFeed`): no process is started per case. The hops between
machines are the runtime's, tested on tabled families (tests/cluster/test_pipeline.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from arch_configs import generic_config
from helpers import assert_logits_close, launch, mlx_lm_reference, run_cli
from tiny_models import write_tiny_model

from exo_tp.arch import mode_reason, table_for
from exo_tp.errors import PlanError
from exo_tp.plan.pipeline import plan_pipeline
from exo_tp.plan.spec import load_spec
from exo_tp.plan.tensor_parallel import plan_tensor_parallel

PROMPT = "Write a short poem about the sea."
TOKENS = 5

# arch -> layers per stage (uneven; 2 and 3 stages)
STAGED = {"starcoder2": (1, 3, 1), "cohere": (3, 1), "internlm2": (1, 2, 1)}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, default_models: dict[str, Path]) -> Any:
    root, tokenizer = tmp_path_factory.mktemp("generic"), default_models["smollm2-135m"]
    written: dict[str, Path] = {}

    def model(arch: str) -> Path:
        if arch not in written:
            written[arch] = write_tiny_model(root / arch, generic_config(arch), tokenizer)
        return written[arch]

    return model


def _staged_forward(folder: Path, counts: tuple[int, ...], adapter: Path | None = None) -> Any:
    """Every stage of a pipeline over ``counts`` layers, each one rank, chained."""
    from mlx_lm.models.cache import make_prompt_cache

    from exo_tp.shard.apply import load_shard
    from exo_tp.shard.tree import get_path

    spec = load_spec(folder)
    table = table_for(spec.model_type)
    plan = plan_pipeline(spec, [[1.0]] * len(counts), counts)
    group = mx.distributed.init()
    n = len(plan.stages)
    stages = [
        load_shard(folder, s.tp, 0, group, mx.float32, s.layers, i == 0, i == n - 1, adapter)
        for i, s in enumerate(plan.stages)
    ]
    caches = [make_prompt_cache(m) for m in stages]

    def forward(tokens: mx.array) -> mx.array:
        hidden = None
        for i, model in enumerate(stages):
            if hidden is not None:
                get_path(model, table.embedding).feed(hidden)
            if i == n - 1:
                return model(tokens, cache=caches[i])
            hidden = get_path(model, table.stack)(tokens, cache=caches[i])
        raise AssertionError("no last stage")

    return forward


def _generate(forward: Any, prompt_ids: list[int]) -> tuple[np.ndarray, list[int]]:
    logits = forward(mx.array(prompt_ids)[None]).astype(mx.float32)
    tokens = [int(mx.argmax(logits[0, -1]).item())]
    prompt_logits = np.array(logits[0])
    while len(tokens) < TOKENS:
        step = forward(mx.array([[tokens[-1]]]))
        tokens.append(int(mx.argmax(step[0, -1]).item()))
    return prompt_logits, tokens


@pytest.mark.parametrize("arch", list(STAGED))
def test_stages_equal_single_device_mlx_lm(models: Any, arch: str) -> None:
    folder = models(arch)
    mode, why = mode_reason(arch)
    assert mode == "pipeline stages only" and arch in why and "\n" not in why
    with pytest.raises(PlanError, match="no tensor-parallel table"):
        plan_tensor_parallel(load_spec(folder), [1.0, 1.0])
    reference = mlx_lm_reference(folder, PROMPT, TOKENS)
    assert len(reference.tokens) == TOKENS and min(reference.margins) >= 1e-3
    logits, tokens = _generate(_staged_forward(folder, STAGED[arch]), reference.prompt_ids)
    assert_logits_close(logits, reference.logits, atol=1e-4)
    assert tokens == reference.tokens


def test_refused_stages_run_whole_on_one_node(models: Any) -> None:
    """Gemma scales its embedding inside the forward pass: a later stage would scale the
    hidden state again, so stages are refused with that reason and it runs whole."""
    folder = models("gemma")
    mode, why = mode_reason("gemma")
    assert mode == "whole on one node" and "embedding" in why and "\n" not in why
    spec = load_spec(folder)
    with pytest.raises(PlanError, match="pipeline stages refused.*embedding"):
        plan_pipeline(spec, [[1.0], [1.0]], (2, 1))
    reference = mlx_lm_reference(folder, PROMPT, TOKENS)
    logits, tokens = _generate(_staged_forward(folder, (spec.num_layers,)), reference.prompt_ids)
    assert_logits_close(logits, reference.logits, atol=1e-4)
    assert tokens == reference.tokens


def test_launch_runs_untabled_stages_end_to_end(tmp_path: Path, models: Any) -> None:
    """One model without a table through `exo-tp launch` (the launcher, the conductor, the
    hops between stages' processes): three one-rank stages holding 1, 3 and 1 layers."""
    folder = models("starcoder2")
    reference = mlx_lm_reference(folder, PROMPT, TOKENS)
    ours = launch(
        tmp_path, folder, [1, 1, 1], PROMPT, TOKENS, "--stages", "1,1,1", "--stage-layers", "1,3,1"
    )
    assert_logits_close(ours.logits, reference.logits, atol=1e-4)
    assert list(ours.report.tokens) == reference.tokens


@pytest.mark.parametrize("arch", ["starcoder2", "internlm2"])
def test_a_stage_receives_from_peers_what_it_reads(
    monkeypatch: pytest.MonkeyPatch, models: Any, arch: str
) -> None:
    """The weight boxes a node without the files is sent for its stage (exo_tp.weights.boxes:
    its layers, the embedding on the first stage and on a tied last one, the final norm and
    head on the last) are what the loader reads for it, tied head and untied."""
    from test_weights_boxes import check_plan

    from exo_tp.weights.build import build_manifest

    folder = models(arch)
    plan = plan_pipeline(load_spec(folder), [[1.0]] * 3, STAGED[arch])
    check_plan(monkeypatch, folder, build_manifest(folder), plan, derived=True)


def test_plan_says_the_mode_and_refuses_a_split_in_one_line(models: Any) -> None:
    """`exo-tp plan` names the mode and why; a TP group of an untabled model and stages of a
    model that cannot be staged are one line of error each, never a traceback."""
    out = run_cli("plan", "--model", str(models("internlm2")), "--weights", "3,1").stdout
    assert out.startswith("mode: pipeline stages only (no tensor-parallel table for internlm2")
    assert "2-stage pipeline" in out
    out = run_cli("plan", "--model", str(models("gemma")), "--weights", "3,1").stdout
    assert out.startswith("mode: whole on one node") and "(the fastest) holds it" in out
    # (gemma's refused stages are the same PlanError, see test_refused_stages_run_whole...)
    result = run_cli(
        "launch", "--ranks", "2", "--stages", "2", "--model", str(models("internlm2")),
        "--prompt", "hi", check=False,
    )  # fmt: skip
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert lines[-1].startswith("exo-tp: error: 2 ranks in one stage: no tensor-parallel table")


def test_launch_plans_an_untabled_model_as_plan_shows_it(tmp_path: Path, models: Any) -> None:
    """`exo-tp launch --weights` of a model without a table runs the stages of whole layers
    that `exo-tp plan --weights` shows (layers by weight, one log line saying so), or the whole
    model on the heaviest rank where its layers cannot be staged; each equal to mlx-lm."""
    folder = models("internlm2")
    shown = run_cli("plan", "--model", str(folder), "--weights", "3,1", "--json").stdout
    layers = [(s["layers"]["start"], s["layers"]["stop"]) for s in json.loads(shown)["stages"]]
    reference = mlx_lm_reference(folder, PROMPT, TOKENS)
    ours = launch(tmp_path, folder, [3, 1], PROMPT, TOKENS)
    assert list(ours.report.tokens) == reference.tokens
    assert len(ours.report.memory_by_rank) == len(layers) == 2
    assert "pipeline stages only (no tensor-parallel table for internlm2" in ours.stderr
    assert f"layers {layers[0][0]}-{layers[0][1]} on ranks 0" in ours.stderr
    gemma = models("gemma")
    (tmp_path / "gemma").mkdir()
    whole = launch(tmp_path / "gemma", gemma, [1, 3], PROMPT, TOKENS)
    assert list(whole.report.tokens) == mlx_lm_reference(gemma, PROMPT, TOKENS).tokens
    assert len(whole.report.memory_by_rank) == 1 and "whole on one node" in whole.stderr


def test_stages_apply_an_mlx_lm_adapter(tmp_path: Path, models: Any) -> None:
    """An mlx-lm LoRA adapter (random, on the last two layers, so that it matters) on an
    untabled model's stages equals mlx-lm loading the model with it."""
    import json

    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    folder = models("internlm2")
    model, _ = load(str(folder))
    lora = {"rank": 4, "dropout": 0.0, "scale": 2.0}
    model.freeze()  # as mlx-lm trains: only the LoRA weights are trainable, saved
    linear_to_lora_layers(model, 2, lora)
    mx.random.seed(1)
    weights = {
        k: 0.1 * mx.random.normal(v.shape) if k.endswith("lora_b") else v
        for k, v in tree_flatten(model.trainable_parameters())
    }
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    mx.save_safetensors(str(adapter / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": lora}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    reference, _ = load(str(folder), adapter_path=str(adapter))
    reference.set_dtype(mx.float32)
    prompt = mx.array([[1, 5, 9, 200, 300, 17, 42, 101]])
    want = np.array(reference(prompt)[0])
    plain = _staged_forward(folder, STAGED["internlm2"])(prompt)
    assert np.abs(np.array(plain[0]) - want).max() > 1e-2  # the adapter changes the logits
    got = _staged_forward(folder, STAGED["internlm2"], adapter)(prompt)
    assert_logits_close(np.array(got[0]), want, atol=1e-4)
