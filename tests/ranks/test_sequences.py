"""A model whose caches cannot be batched, batched one sequence at a time (DeepSeek V4.1).

tests/ranks/test_family_batching.py runs it through the runtime's whole batch; here the pieces the
batch relies on: right-padded prompts of different lengths in one pass, a cache extracted for
the prompt cache that stays as it was while its sequence goes on, and such a batch through two
pipeline stages (exo_tp.shard.streams), against mlx-lm on each prompt alone.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from arch_configs import tiny_config
from mlx_lm.generate import _merge_caches, _right_pad_prompts
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import write_tiny_model

from exo_tp.plan.spec import load_spec
from exo_tp.plan.tensor_parallel import plan_tensor_parallel
from exo_tp.shard.apply import load_shard

PROMPTS = [[1, 5, 9, 33, 70, 2, 8, 100, 200], [300, 11, 12, 13], [7, 7, 40, 41, 42, 43]]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, default_models: dict[str, Path]) -> tuple:
    from mlx_lm.utils import load_model

    folder = write_tiny_model(
        tmp_path_factory.mktemp("v41") / "deepseek_v41",
        tiny_config("deepseek_v41"),
        default_models["smollm2-135m"],
    )
    reference, _ = load_model(folder)  # mlx-lm's own, one sequence at a time
    plan = plan_tensor_parallel(load_spec(folder), [1.0])
    return reference, load_shard(folder, plan, 0, mx.distributed.init(), mx.float32)


def _alone(model: object, ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array(ids)[None], cache=make_prompt_cache(model))[0])


def test_right_padded_prompts_equal_each_prompt_alone(models: tuple) -> None:
    reference, ours = models
    caches = _merge_caches([make_prompt_cache(ours) for _ in PROMPTS])
    lengths = [len(p) for p in PROMPTS]
    padding = [max(lengths) - n for n in lengths]
    for cache in caches:
        cache.prepare(lengths=lengths, right_padding=padding)
    logits = ours(_right_pad_prompts(PROMPTS, max_length=max(lengths)), cache=caches)
    for cache in caches:
        cache.finalize()
    for row, ids in enumerate(PROMPTS):
        got = np.array(logits[row, : len(ids)])
        np.testing.assert_allclose(got, _alone(reference, ids), atol=1e-5)
    # then one decoding step for all three, each at its own position
    step = ours(mx.array([[3], [4], [5]]), cache=caches)
    for row, ids in enumerate(PROMPTS):
        want = _alone(reference, [*ids, 3 + row])[-1]
        np.testing.assert_allclose(np.array(step[row, -1]), want, atol=1e-5)


def test_an_extracted_cache_stays_as_it_was(models: tuple) -> None:
    _, ours = models
    caches = _merge_caches([make_prompt_cache(ours) for _ in PROMPTS[:2]])
    ours(mx.array([PROMPTS[0][:4], PROMPTS[1][:4]]), cache=caches)
    kept = [c.extract(0) for c in caches]
    ours(mx.array([[3], [4]]), cache=caches)  # the sequence goes on in the batch
    assert kept[0].caches[0].offset == 4 and caches[0].caches[0].offset == 5


def test_two_stages_hand_a_batch_on_in_one_message(
    tmp_path: Path, default_models: dict[str, Path]
) -> None:
    """A batch of right-padded prompts through two pipeline stages (layers 0-1, 2-3: the cut
    hands on the streams, their mix and every kind of shared state, one message per sequence,
    back to back) equals each prompt alone in mlx-lm, prompt and next step."""
    from mlx_lm.utils import load_model

    from exo_tp.plan import Span
    from exo_tp.shard.tree import get_path

    folder = write_tiny_model(
        tmp_path / "v41", tiny_config("deepseek_v41"), default_models["smollm2-135m"]
    )
    reference, _ = load_model(folder)
    plan = plan_tensor_parallel(load_spec(folder), [1.0])
    group = mx.distributed.init()
    stages = [
        load_shard(folder, plan, 0, group, mx.float32, Span(start=a, stop=b), a == 0, b == 4)
        for a, b in ((0, 2), (2, 4))
    ]
    inner, feed = stages[0].model, get_path(stages[1], "model.embed_tokens")
    caches = [_merge_caches([make_prompt_cache(s) for _ in PROMPTS]) for s in stages]

    def forward(tokens: mx.array) -> mx.array:
        feed.feed(inner(tokens, cache=caches[0]))
        return stages[1](tokens, cache=caches[1])

    lengths = [len(p) for p in PROMPTS]
    padding = [max(lengths) - n for n in lengths]
    for cache in (*caches[0], *caches[1]):
        cache.prepare(lengths=lengths, right_padding=padding)
    logits = forward(_right_pad_prompts(PROMPTS, max_length=max(lengths)))
    for cache in (*caches[0], *caches[1]):
        cache.finalize()
    step = forward(mx.array([[3], [4], [5]]))
    for row, ids in enumerate(PROMPTS):
        got = np.array(logits[row, : len(ids)])
        np.testing.assert_allclose(got, _alone(reference, ids), atol=1e-5)
        want = _alone(reference, [*ids, 3 + row])[-1]
        np.testing.assert_allclose(np.array(step[row, -1]), want, atol=1e-5)
