"""Prompt-lookup speculative decoding (exo_tp.runtime.speculative) gives greedy decoding's
tokens exactly, against single-device mlx-lm (float32) and exo-tp without speculation.

The prompt asks to repeat text, so drafts looked up in it are accepted (asserted: with no
accepted draft these tests would pass without speculating at all). Two real launches on 2
uneven ranks (the conductor's stop strings and the token broadcast), the rest in this process
on one LockstepBatch (finishes inside an accepted run, the prompt cache it leaves).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from arch_configs import tiny_config
from helpers import Reference, _single_device, launch, mlx_lm_reference
from mlx_lm.models.cache import make_prompt_cache
from test_arch_matrix import MIN_MARGIN, SEEDS
from tiny_models import write_tiny_model

from exo_tp.plan.spec import load_spec
from exo_tp.plan.tensor_parallel import plan_tensor_parallel
from exo_tp.runtime.batching import LockstepBatch
from exo_tp.runtime.speculative import prompt_lookup
from exo_tp.shard.apply import load_shard
from exo_tp.wire.assignment import ServingOptions
from exo_tp.wire.runtime import Insert

PROMPT = (
    "Repeat this list exactly, line by line:\n"
    "apple banana cherry date elderberry fig grape\n"
    "one two three four five six seven eight nine ten\n"
    "the quick brown fox jumps over the lazy dog"
)
TOKENS = 40
DRAFTS = 4
# First met in SmolLM2's answer where it starts its second sentence: "The" is the step's own
# token and " quick brown fox" its accepted drafts (looked up in its first sentence), so
# the match ends inside the run and the run's last two tokens must not reach the text
STOP = "\n\nThe quick"


@pytest.fixture(scope="module")
def reference(default_models: dict[str, Path]) -> Reference:
    return mlx_lm_reference(default_models["smollm2-135m"], PROMPT, TOKENS)


def test_prompt_lookup_drafts_what_followed_the_latest_longest_match() -> None:
    history = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # "2 3" last occurred before 7 8 (the latest of two), 3 tokens asked
    assert prompt_lookup(history, 2, 3) == [7, 8, 5]
    # a 3-gram "5 2 3" never occurred before: the 2-gram's match
    assert prompt_lookup(history, 3, 2) == [7, 8]
    assert prompt_lookup([4, 5, 6], 3, 4) == []  # nothing repeats
    assert prompt_lookup([4, 5, 4], 1, 4) == [5, 4]  # the continuation may run to the end


def test_the_api_takes_num_draft_tokens_refuses_draft_model_and_reports_predictions() -> None:
    from pydantic import ValidationError

    from exo_tp.api.errors import ApiError
    from exo_tp.api.openai_schema import ChatCompletionRequest, refuse_unsupported
    from exo_tp.api.openai_shapes import usage
    from exo_tp.wire.runtime import Done

    body = {"messages": [{"role": "user", "content": "x"}], "num_draft_tokens": 5}
    assert ChatCompletionRequest.model_validate(body).num_draft_tokens == 5
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({**body, "num_draft_tokens": 33})
    with pytest.raises(ApiError, match="draft_model"):
        refuse_unsupported({**body, "draft_model": "mlx-community/SmolLM2-135M"})
    done = Done(id="a", finish_reason="stop", prompt_tokens=3, completion_tokens=9)
    assert "completion_tokens_details" not in usage(done).body()  # nothing drafted
    drafted = done.model_copy(update={"drafted_tokens": 12, "accepted_tokens": 7})
    assert usage(drafted).body()["completion_tokens_details"] == {
        "accepted_prediction_tokens": 7,
        "rejected_prediction_tokens": 5,
    }


def test_two_uneven_ranks_greedy_identical_with_a_stop_string_in_an_accepted_run(
    tmp_path: Path, reference: Reference
) -> None:
    assert STOP in reference.text, reference.text  # the prompt still makes SmolLM2 repeat
    expected = reference.text[: reference.text.index(STOP)]
    runs = {}
    for drafts in (DRAFTS, 0):
        folder = tmp_path / str(drafts)
        folder.mkdir()
        runs[drafts] = launch(
            folder,
            "smollm2-135m",
            [3, 2],
            PROMPT,
            TOKENS,
            "--num-draft-tokens",
            str(drafts),
            "--stop",
            STOP,
            logits=False,
        )
    speculative, plain = runs[DRAFTS].report, runs[0].report
    assert speculative.accepted_tokens > 0, speculative
    assert plain.drafted_tokens == 0
    assert speculative.text == plain.text == expected
    assert speculative.finish_reason == plain.finish_reason == "stop"
    assert speculative.tokens == plain.tokens
    assert list(speculative.tokens) == reference.tokens[: len(speculative.tokens)]


def _decode(
    eos: list[int], prompt: list[int], max_tokens: int, cache_entries: int = 0
) -> tuple[list[int], str | None, list[tuple[int, int, int]], LockstepBatch]:
    """Greedy decoding of one stream on a LockstepBatch over the whole model (no ranks: the
    sampler is a plain argmax), speculating with DRAFTS drafts: tokens, finish reason, each
    speculative step's (index of its first token, drafted, accepted), and the batch."""
    model, _ = _single_device(_model_dir())
    options = ServingOptions(
        max_concurrency=1, prompt_cache_size=cache_entries, num_draft_tokens=DRAFTS
    )
    batch = LockstepBatch(
        model, eos, options, lambda lp: (mx.argmax(lp, axis=-1), 0), 4096, speculate=True
    )
    steps: list[tuple[int, int, int]] = []
    tokens: list[int] = []
    reason = None
    batch.on_drafts = lambda uid, drafted, accepted: steps.append((len(tokens), drafted, accepted))
    insert = Insert(uid=0, tokens=tuple(prompt), max_tokens=max_tokens, draft_tokens=DRAFTS)
    batch.insert(insert)
    while not batch.idle:
        for response in batch.step():
            tokens.append(response.token)
            reason = response.finish_reason
    return tokens, reason, steps, batch


def _model_dir() -> str:
    from exo_tp.models.registry import resolve_model

    return str(resolve_model("smollm2-135m"))


@pytest.fixture(scope="module")
def full_run(reference: Reference) -> tuple[list[int], list[tuple[int, int, int]]]:
    """The whole answer, speculating in this process: its tokens and speculative steps."""
    _, tokenizer = _single_device(_model_dir())
    tokens, _, steps, _ = _decode(list(tokenizer.eos_token_ids), reference.prompt_ids, TOKENS)
    assert tokens == reference.tokens
    return tokens, steps


def test_max_tokens_inside_an_accepted_run(
    reference: Reference, full_run: tuple[list[int], list[tuple[int, int, int]]]
) -> None:
    """max_tokens that ends inside a run the full answer accepted: the step drafts only up
    to it, and the answer is greedy decoding's, cut there."""
    _, tokenizer = _single_device(_model_dir())
    _, steps = full_run
    start = next(start for start, _, accepted in steps if accepted >= 2)
    max_tokens = start + 2  # the pending token, one draft, then the end
    tokens, reason, cut_steps, _ = _decode(
        list(tokenizer.eos_token_ids), reference.prompt_ids, max_tokens
    )
    assert tokens == reference.tokens[:max_tokens] and reason == "length"
    assert (start, 1, 1) in cut_steps, cut_steps


def test_a_finish_inside_an_accepted_run_cuts_it_and_the_cache_it_leaves(
    reference: Reference, full_run: tuple[list[int], list[tuple[int, int, int]]]
) -> None:
    """An end-of-sequence token met inside a run of accepted drafts: the run is cut after it
    and the stream's KV cache, stored in the prompt cache, holds exactly its tokens."""
    model, _ = _single_device(_model_dir())
    full, steps = full_run
    # a token that first occurs inside a step's accepted run, before its last token (a
    # step emits its pending token and then the accepted drafts)
    first = {t: i for i, t in reversed(list(enumerate(full)))}
    inside = [
        t
        for t, i in first.items()
        if any(start <= i < start + accepted for start, _, accepted in steps)
    ]
    assert inside, (full, steps)
    stop = inside[0]
    expected = reference.tokens[: first[stop] + 1]
    tokens, reason, _, batch = _decode([stop], reference.prompt_ids, TOKENS, cache_entries=4)
    assert tokens == expected and reason == "stop"
    # the prompt cache's entry: keyed by prompt + tokens, and its keys those a fresh prefill
    # of exactly those tokens computes (no rejected or dropped position left in it)
    key = [*reference.prompt_ids, *tokens]
    assert batch.prompt_cache is not None
    cache, covered = batch.prompt_cache.fetch([*key, 0])
    assert cache is not None and covered == len(key)
    fresh = make_prompt_cache(model)
    model(mx.array(key)[None], cache=fresh)
    for stored, computed in zip(cache, fresh, strict=True):
        assert stored.offset == computed.offset == len(key)
        for ours, theirs in zip(stored.keys_and_values(), computed.keys_and_values(), strict=True):
            assert ours.shape == theirs.shape
            assert mx.allclose(ours, theirs, atol=1e-4).item()


def test_a_second_stream_turns_speculation_off_and_both_stay_greedy(
    reference: Reference, full_run: tuple[list[int], list[tuple[int, int, int]]]
) -> None:
    """A stream joins one that speculates: no step speculates while both run (the batch's
    lockstep), the first speculates again once alone, and both answers are greedy decoding's."""
    model, tokenizer = _single_device(_model_dir())
    options = ServingOptions(max_concurrency=2, prompt_cache_size=0, num_draft_tokens=DRAFTS)
    batch = LockstepBatch(
        model,
        list(tokenizer.eos_token_ids),
        options,
        lambda lp: (mx.argmax(lp, axis=-1), 0),
        4096,
        speculate=True,
    )
    alone: list[bool] = []  # at each speculative step: whether its stream was alone
    tokens: dict[int, list[int]] = {0: [], 1: []}
    batch.on_drafts = lambda uid, drafted, accepted: alone.append(len(batch.active) == 1)
    prompt = tuple(reference.prompt_ids)
    batch.insert(Insert(uid=0, tokens=prompt, max_tokens=TOKENS, draft_tokens=DRAFTS))
    while len(tokens[0]) < 8:  # the first is well into its answer, speculating
        for response in batch.step():
            tokens[response.uid].append(response.token)
    speculated_before = len(alone)
    second = Insert(uid=1, tokens=prompt, max_tokens=TOKENS // 4, draft_tokens=DRAFTS)
    batch.insert(second)
    while not batch.idle:
        for response in batch.step():
            tokens[response.uid].append(response.token)
    assert speculated_before > 0 and all(alone), alone
    assert len(alone) > speculated_before  # alone again after the second finished
    assert tokens[0] == reference.tokens
    assert tokens[1] == reference.tokens[: TOKENS // 4]


# llama: plain KV caches (it speculates); gemma3_text and mistral: sliding windows (8 tokens
# here); qwen3_next: a recurrent state (Gated DeltaNet). Tiny random checkpoints, whole in this
# process on the engine's loader.
FAMILIES = {"llama": True, "gemma3_text": False, "mistral": False, "qwen3_next": False}


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_only_trimmable_families_speculate_and_all_stay_greedy(
    tmp_path: Path, default_models: dict[str, Path], arch: str
) -> None:
    from mlx_lm import load, stream_generate

    folder = write_tiny_model(
        tmp_path / arch, tiny_config(arch), default_models["smollm2-135m"], seed=SEEDS.get(arch, 0)
    )
    model, tokenizer = load(str(folder))  # the reference
    model.set_dtype(mx.float32)
    plan = plan_tensor_parallel(load_spec(folder), [1.0])
    ours = load_shard(folder, plan, 0, mx.distributed.init(), mx.float32)
    # shorter than the windows (8): mlx-lm calls a window trimmable until it is full, and a
    # verify step would fill it; a repeat, so that drafts are found
    prompt = [258, 85, 252, 258, 85]
    options = ServingOptions(max_concurrency=1, prompt_cache_size=0, num_draft_tokens=DRAFTS)
    batch = LockstepBatch(
        ours,
        list(tokenizer.eos_token_ids),
        options,
        lambda lp: (mx.argmax(lp, axis=-1), 0),
        0,
        speculate=True,
    )
    steps: list[int] = []
    batch.on_drafts = lambda uid, drafted, accepted: steps.append(drafted)
    batch.insert(Insert(uid=0, tokens=tuple(prompt), max_tokens=12, draft_tokens=DRAFTS))
    tokens = []
    while not batch.idle:
        tokens += [response.token for response in batch.step()]
    reference, margins = [], []
    for response in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=12):
        reference.append(response.token)
        top2 = sorted(response.logprobs.astype(mx.float32).tolist())[-2:]
        margins.append(top2[1] - top2[0])
    assert bool(steps) == FAMILIES[arch], steps
    decided = next((i for i, m in enumerate(margins) if m < MIN_MARGIN), len(reference))
    assert tokens[:decided] == reference[:decided], (tokens, reference, margins)
