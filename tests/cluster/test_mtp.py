"""Native MTP speculation (exo_tp.runtime.mtp, issue #61): the checkpoint's own MTP heads
draft on the last stage's ranks, and the answer stays the target's.

Tiny random checkpoints carrying MTP heads as Qwen 3.5 and GLM-5 store them
(tests/mtp_models.py), the heads trained on the model's own continuations of the prompt so
that drafts are kept (asserted: with none kept these tests would pass without speculating),
on 3 uneven ranks against single-device mlx-lm without MTP; random heads (every draft
rejected: the Qwen 3.5 model's recurrent states restored and replayed each step); two
pipeline stages; and, in this process, the sampled distribution (the test of #44).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from helpers import Reference, launch, mlx_lm_reference
from mtp_models import trained, write_mtp_model
from test_arch_matrix import MIN_MARGIN
from test_speculative import SAMPLED_RUNS, TEMPERATURE, assert_target_distribution, sampled_runs

from exo_tp.plan.spec import load_spec
from exo_tp.plan.tensor_parallel import plan_tensor_parallel
from exo_tp.runtime.batching import LockstepBatch
from exo_tp.runtime.sampling import request_sampler
from exo_tp.shard.apply import load_shard
from exo_tp.wire.assignment import ServingOptions
from exo_tp.wire.runtime import SamplingParams

PROMPT = "Repeat: apple banana cherry apple banana cherry"
TOKENS = 24
STEPS = {"qwen3_5": 40, "glm_moe_dsa": 25}  # training steps that get most drafts kept


@pytest.fixture(scope="module")
def models(
    tmp_path_factory: pytest.TempPathFactory, default_models: dict[str, Path]
) -> dict[str, tuple[Path, Path, Reference]]:
    """Per family: the random checkpoint, its copy with trained heads, mlx-lm's answer."""
    root = tmp_path_factory.mktemp("mtp")
    out = {}
    for arch, steps in STEPS.items():
        random = write_mtp_model(root / arch, arch, default_models["smollm2-135m"])
        reference = mlx_lm_reference(random, PROMPT, TOKENS)
        learned = trained(random, root / f"{arch}-trained", [reference.prompt_ids], steps)
        out[arch] = (random, learned, reference)
    return out


def _greedy_prefix(reference: Reference) -> int:
    """Tokens up to the first near-tie (where fp32 noise may decide: test_arch_matrix)."""
    return next((i for i, m in enumerate(reference.margins) if m < MIN_MARGIN), TOKENS)


@pytest.mark.parametrize("arch", list(STEPS))
def test_three_uneven_ranks_keep_mtp_drafts_and_give_mlx_lm_tokens(
    tmp_path: Path, models: dict[str, tuple[Path, Path, Reference]], arch: str
) -> None:
    _, learned, reference = models[arch]
    report = launch(tmp_path, learned, [3, 2, 1], PROMPT, TOKENS, "--mtp", logits=False).report
    assert report.accepted_tokens > 0, report
    decided = _greedy_prefix(reference)
    assert list(report.tokens)[:decided] == reference.tokens[:decided]


def test_random_heads_on_a_hybrid_model_reject_and_stay_exact(
    tmp_path: Path, models: dict[str, tuple[Path, Path, Reference]]
) -> None:
    """Every draft of a random head is rejected: each verify step restores the Gated
    DeltaNet states (the rank holding none of its heads included) and replays the kept
    token; the tokens are still mlx-lm's."""
    random, _, reference = models["qwen3_5"]
    report = launch(tmp_path, random, [3, 2, 1], PROMPT, TOKENS, "--mtp", logits=False).report
    assert report.drafted_tokens > report.accepted_tokens, report
    decided = _greedy_prefix(reference)
    assert list(report.tokens)[:decided] == reference.tokens[:decided]


def test_pipeline_stages_draft_on_the_last_stage(
    tmp_path: Path, models: dict[str, tuple[Path, Path, Reference]]
) -> None:
    """Two stages (2 ranks, then 1): the last stage's ranks draft, the first stage gets
    the drafts by message and verifies them with its layers."""
    _, learned, reference = models["qwen3_5"]
    extra = ("--mtp", "--stages", "2,1")
    report = launch(tmp_path, learned, [2, 1, 1], PROMPT, TOKENS, *extra, logits=False).report
    assert report.accepted_tokens > 0, report
    decided = _greedy_prefix(reference)
    assert list(report.tokens)[:decided] == reference.tokens[:decided]


def test_a_model_without_mtp_heads_is_served_as_before(
    tmp_path: Path, default_models: dict[str, Path]
) -> None:
    """--mtp on a checkpoint without heads: a warning, no drafts, the same answer."""
    result = launch(tmp_path, "smollm2-135m", [2, 1], PROMPT, 8, "--mtp", logits=False)
    assert result.report.drafted_tokens == 0
    assert "no MTP drafts" in result.stderr
    reference = mlx_lm_reference(default_models["smollm2-135m"], PROMPT, 8)
    assert list(result.report.tokens) == reference.tokens


def test_sampled_mtp_drafts_keep_the_target_distribution(
    models: dict[str, tuple[Path, Path, Reference]],
) -> None:
    """At a temperature each token a verify step decides is distributed as single-device
    mlx-lm says (the probability integral transform is uniform), with the trained heads'
    drafts on one rank in this process; the same test rejects the greedy tokens."""
    from mlx_lm import load

    from exo_tp.arch import table_for
    from exo_tp.runtime.mtp.checkpoint import load_heads
    from exo_tp.runtime.mtp.drafter import MtpDrafter
    from exo_tp.runtime.mtp.on_rank import _stage_parts
    from exo_tp.runtime.mtp.tap import HiddenTap
    from exo_tp.shard.tree import get_path, set_path

    _, folder, reference_answer = models["qwen3_5"]
    reference, tokenizer = load(str(folder))
    reference.set_dtype(mx.float32)
    group = mx.distributed.init()
    plan = plan_tensor_parallel(load_spec(folder), [1.0])
    ours = load_shard(folder, plan, 0, group, mx.float32)
    table = table_for("qwen3_5")
    parts = _stage_parts(ours, table)
    assert parts is not None
    tap = HiddenTap(get_path(ours, table.norm))
    set_path(ours, table.norm, tap)
    drafter = MtpDrafter(load_heads(folder, mx.float32), tap, *parts, group, True)
    sampler = request_sampler(SamplingParams(temperature=TEMPERATURE), tokenizer)
    options = ServingOptions(max_concurrency=1, prompt_cache_size=0)
    batch = LockstepBatch(
        ours, [], options, lambda lp: (sampler(lp), 0), 0, speculate=True, drafter=drafter
    )
    prompt = reference_answer.prompt_ids
    mx.random.seed(7)
    runs, drafted, accepted = sampled_runs(batch, prompt, SAMPLED_RUNS // 3, 3)
    assert accepted >= 30 and drafted - accepted >= 30, (drafted, accepted)
    assert_target_distribution(reference, prompt, runs, 300)


def test_a_node_cluster_serves_with_mtp_drafts_stop_strings_and_the_prompt_cache(
    models: dict[str, tuple[Path, Path, Reference]],
) -> None:
    """`exo-tp run --local-nodes 3 --weights 3,2,1 --mtp` with the trained Qwen 3.5 heads: a
    chat answer is mlx-lm's with drafts kept (usage), cut at a stop string met inside the
    answer; the same conversation again (its prompt in the prompt cache) answers alike; the
    cluster view shows the heads held."""
    from cluster_helpers import http_json, local_cluster

    _, learned, reference = models["qwen3_5"]
    decided = _greedy_prefix(reference)
    text = reference.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # met after drafts were kept
    with local_cluster(3, weights=[3, 2, 1], model=str(learned), extra=("--mtp",)) as cluster:
        body = {
            "model": str(learned),
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": TOKENS,
            "temperature": 0,
        }
        answers = []
        for url in (cluster.urls[0], cluster.urls[2]):  # the second: the prompt cache's entry
            status, answer = http_json(url + "/v1/chat/completions", body, timeout=300)
            assert status == 200, answer
            answers.append(answer)
        status, stopped = http_json(
            cluster.urls[1] + "/v1/chat/completions", {**body, "stop": [stop]}, timeout=300
        )
        _, view = http_json(cluster.urls[0] + "/v1/cluster")
    assert status == 200, stopped
    assert decided == TOKENS  # no near-tie in mlx-lm's answer: the text is exactly its text
    assert [a["choices"][0]["message"]["content"] for a in answers] == [text, text]
    assert stopped["choices"][0]["message"]["content"] == text[: text.index(stop)]
    assert stopped["choices"][0]["finish_reason"] == "stop"
    for answer in answers:
        assert answer["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0
    assert view["serving"]["mtp"] == "on" and view["serving"]["mtp_bytes"] > 0
