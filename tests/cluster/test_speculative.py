"""Prompt-lookup speculative decoding (exo_tp.runtime.speculative) gives greedy decoding's
tokens exactly, against single-device mlx-lm (float32) and exo-tp without speculation.

The prompt asks to repeat text, so drafts looked up in it are accepted (asserted: with no
accepted draft these tests would pass without speculating at all). Real launches on 2 uneven
ranks (the conductor's stop strings and the token broadcast) and on two pipeline stages (the
verify step across the hop), the rest in this process on one LockstepBatch (finishes inside an
accepted run, the prompt cache it leaves).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from arch_configs import tiny_config
from helpers import Reference, _single_device, launch, mlx_lm_reference, run_cli
from mlx_lm.models.cache import make_prompt_cache
from test_arch_matrix import MIN_MARGIN, SEEDS
from tiny_models import write_tiny_model

from exo_tp.plan.spec import load_spec
from exo_tp.plan.tensor_parallel import plan_tensor_parallel
from exo_tp.runtime.batching import LockstepBatch
from exo_tp.runtime.sampling import request_sampler
from exo_tp.runtime.speculative import Backoff, prompt_lookup
from exo_tp.shard.apply import load_shard
from exo_tp.wire.assignment import ServingOptions
from exo_tp.wire.runtime import Insert, SamplingParams

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


def test_drafting_pauses_where_it_stops_paying_and_tries_again() -> None:
    """A stream whose verify steps emit under Backoff.PAYS tokens on average pauses for 8
    steps, then 16 after failing again; one that pays resets the pause; others go on."""
    backoff = Backoff()
    for step in range(4):  # nothing kept: 1 token a verify step
        assert backoff.allows(0, step)
        backoff.record(0, step, 0)
    assert backoff.allows(1, 4)  # another stream is not paused
    assert not backoff.allows(0, 10) and backoff.allows(0, 11)
    for step in range(11, 15):
        backoff.record(0, step, 0)
    assert not backoff.allows(0, 29) and backoff.allows(0, 30)
    for step in range(30, 34):  # 2 of 4 kept: 3 tokens a verify step, it pays
        backoff.record(0, step, 2)
    for step in range(34, 37):  # the window slides: [3, 1, 1, 1] at step 36 no longer pays
        backoff.record(0, step, 0)
    assert not backoff.allows(0, 43) and backoff.allows(0, 44)  # the first pause again


def test_the_api_takes_num_draft_tokens_refuses_draft_model_and_reports_predictions() -> None:
    from pydantic import ValidationError

    from exo_tp.api.core.errors import ApiError
    from exo_tp.api.openai.schema import ChatCompletionRequest
    from exo_tp.api.openai.shapes import usage
    from exo_tp.api.openai.unsupported import refuse_unsupported
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


def test_two_uneven_ranks_speculate_when_sampling(tmp_path: Path) -> None:
    """A request at a temperature speculates through the conductor's sampler and its token
    broadcast (every rank keeps the same drafts): drafts are kept, and the answer ends as
    asked (its distribution: test_sampled_speculation_keeps_the_target_distribution)."""
    result = launch(
        tmp_path,
        "smollm2-135m",
        [3, 2],
        PROMPT,
        TOKENS // 2,
        "--num-draft-tokens",
        str(DRAFTS),
        "--temp",
        "0.3",
        "--seed",
        "3",
        logits=False,
    )
    report = result.report
    assert report.drafted_tokens > 0 and report.accepted_tokens > 0, report
    assert len(report.tokens) == TOKENS // 2 and report.finish_reason == "length"


def greedy_batch(
    model: Any, eos: list[int], options: ServingOptions, **extra: Any
) -> LockstepBatch:
    """A speculating LockstepBatch over a whole model in this process (no ranks: the sampler
    is a plain argmax); ``extra``: LockstepBatch's other options (a drafter, verified rows)."""
    sample = lambda lp: (mx.argmax(lp, axis=-1), 0)  # noqa: E731
    return LockstepBatch(model, eos, options, sample, 4096, speculate=True, **extra)


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
    batch = greedy_batch(model, eos, options)
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
    batch = greedy_batch(model, list(tokenizer.eos_token_ids), options)
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
# here: they do not); qwen3_next: a recurrent state (Gated DeltaNet) beside its KV layers, kept
# from before each verify step and replayed where drafts were rejected (it speculates). Tiny
# random checkpoints, whole in this process on the engine's loader.
FAMILIES = {"llama": True, "gemma3_text": False, "mistral": False, "qwen3_next": True}


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_only_rewindable_families_speculate_and_all_stay_greedy(
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
    batch = greedy_batch(ours, list(tokenizer.eos_token_ids), options)
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


# Sampled speculation, tested statistically. At 0.3 the tiny model's most likely token holds
# about 0.3-0.9 of the mass: drafts are often kept and often rejected, both branches matter.
TEMPERATURE = 0.2
SAMPLED_RUNS, SAMPLED_TOKENS = 150, 20
KS_LIMIT = 1.95  # Kolmogorov-Smirnov at a 0.1% false alarm: D * sqrt(n) above it rejects


def _pit(rows: np.ndarray, tokens: list[int], rng: np.random.Generator) -> np.ndarray:
    """Randomised probability integral transform of each token under its row's
    probabilities, tokens ranked most likely first: uniform on [0, 1] exactly when each token
    was drawn from its row (and independent draws give independent values). Ranking by
    likelihood puts the likely tokens, which drafts mostly are, at the low end: a sampler
    that keeps drafts too often piles values up there."""
    out = []
    for row, token in zip(rows, tokens, strict=True):
        # ties ranked by token id: the lower ids count as the more likely
        likelier = (row > row[token]) | ((row == row[token]) & (np.arange(len(row)) < token))
        out.append(row[likelier].sum() + rng.random() * row[token])
    return np.array(out)


def _ks(values: np.ndarray) -> float:
    """The Kolmogorov-Smirnov distance of ``values`` from the uniform law, times sqrt(n)."""
    u, n = np.sort(values), len(values)
    ranks = np.arange(1, n + 1)
    return float(max((ranks / n - u).max(), (u - (ranks - 1) / n).max()) * np.sqrt(n))


def test_sampled_speculation_keeps_the_target_distribution(
    tmp_path: Path, default_models: dict[str, Path]
) -> None:
    """At a temperature, each token a verify step decides (the kept drafts and the token
    after them) is distributed as single-device mlx-lm's model says given the tokens before
    it: the probability integral transform of those tokens under mlx-lm's probabilities is
    uniform (Kolmogorov-Smirnov). The same test rejects the greedy tokens, so it can fail."""
    from mlx_lm import load

    folder = write_tiny_model(
        tmp_path / "llama", tiny_config("llama"), default_models["smollm2-135m"]
    )
    reference, tokenizer = load(str(folder))
    reference.set_dtype(mx.float32)
    plan = plan_tensor_parallel(load_spec(folder), [1.0])
    ours = load_shard(folder, plan, 0, mx.distributed.init(), mx.float32)
    # the conductor's sampler for a request at this temperature (row by row there; one call
    # over the rows here, each row drawn alike)
    sampler = request_sampler(SamplingParams(temperature=TEMPERATURE), tokenizer)
    options = ServingOptions(max_concurrency=1, prompt_cache_size=0, num_draft_tokens=DRAFTS)
    batch = LockstepBatch(ours, [], options, lambda lp: (sampler(lp), 0), 0, speculate=True)
    prompt = [258, 85, 252, 258, 85, 252, 258, 85]  # repeats: drafts from the first token
    mx.random.seed(7)
    runs, drafted, accepted = sampled_runs(batch, prompt, SAMPLED_RUNS, 4)
    # both branches of the rule, many times over
    assert accepted >= 30 and drafted - accepted >= 200, (drafted, accepted)
    assert_target_distribution(reference, prompt, runs, 600)


Run = tuple[list[int], set[int]]  # a sampled answer's tokens, and those a verify step decided


def sampled_runs(
    batch: LockstepBatch, prompt: list[int], count: int, drafts: int
) -> tuple[list[Run], int, int]:
    """``count`` sampled answers to ``prompt`` on ``batch`` (one after another, each with
    ``drafts`` drafts a step), and the tokens drafted and accepted in all."""
    runs: list[Run] = []
    counts = [0, 0]
    for uid in range(count):
        tokens: list[int] = []
        decided: set[int] = set()

        def record(_: int, drafted: int, kept: int, out: list[int] = tokens, d=decided) -> None:
            counts[0], counts[1] = counts[0] + drafted, counts[1] + kept
            # the step emits the pending token (index len(out)) and the kept drafts, and
            # samples the token after them: those it decided are the indices after the first
            d.update(range(len(out) + 1, len(out) + kept + 2))

        batch.on_drafts = record
        insert = Insert(
            uid=uid, tokens=tuple(prompt), max_tokens=SAMPLED_TOKENS, draft_tokens=drafts
        )
        batch.insert(insert)
        while not batch.idle:
            tokens += [response.token for response in batch.step()]
        runs.append((tokens, {i for i in decided if i < len(tokens)}))
    return runs, counts[0], counts[1]


def assert_target_distribution(
    reference: Any, prompt: list[int], runs: list[Run], least: int
) -> None:
    """The tokens verify steps decided follow ``reference``'s distribution at TEMPERATURE
    given the tokens before them (the probability integral transform is uniform, at least
    ``least`` of them), and the same test rejects the greedy tokens (so it can fail)."""
    rng = np.random.default_rng(0)
    sampled, greedy = [], []
    for tokens, decided in runs:
        logits = reference(mx.array(prompt + tokens[:-1])[None])[0, len(prompt) - 1 :]
        rows = np.array(mx.softmax(logits.astype(mx.float32) / TEMPERATURE, axis=-1))
        picked = sorted(decided)
        sampled.append(_pit(rows[picked], [tokens[i] for i in picked], rng))
        greedy.append(_pit(rows[picked], rows[picked].argmax(axis=-1).tolist(), rng))
    values = np.concatenate(sampled)
    assert len(values) >= least, len(values)
    assert _ks(values) < KS_LIMIT, (_ks(values), len(values))
    assert _ks(np.concatenate(greedy)) > KS_LIMIT


# ---- a draft model (--draft-model) ------------------------------------------------------


def test_two_uneven_ranks_with_a_draft_model_give_greedy_tokens(
    tmp_path: Path, reference: Reference
) -> None:
    """SmolLM2 drafting for itself on 2 uneven ranks: the conductor's drafts reach every rank
    (its broadcast), most are kept, and the answer is single-device mlx-lm's."""
    result = launch(
        tmp_path,
        "smollm2-135m",
        [3, 2],
        PROMPT,
        TOKENS,
        "--draft-model",
        _model_dir(),
        logits=False,
    )
    report = result.report
    assert report.drafted_tokens > 0 and report.accepted_tokens > report.drafted_tokens // 2
    assert list(report.tokens) == reference.tokens


def _draft_decode(
    target: object, draft: object, prompt: list[int], tokens: int, eos: list[int]
) -> tuple[list[int], int, int]:
    """Greedy decoding of one stream on a LockstepBatch over ``target`` (one rank), drafting
    with ``draft``: its tokens, drafted and accepted counts."""
    from exo_tp.runtime.draft_model import ModelDrafter

    options = ServingOptions(max_concurrency=1, prompt_cache_size=0, num_draft_tokens=DRAFTS)
    drafter = ModelDrafter(draft, mx.distributed.init())  # type: ignore[arg-type]
    batch = greedy_batch(target, eos, options, drafter=drafter)
    counts = [0, 0]

    def record(_: int, drafted: int, accepted: int) -> None:
        counts[0] += drafted
        counts[1] += accepted

    batch.on_drafts = record
    out: list[int] = []
    for uid in range(2):  # a second stream: the draft model's cache starts afresh
        batch.insert(Insert(uid=uid, tokens=tuple(prompt), max_tokens=tokens, draft_tokens=DRAFTS))
        while not batch.idle:
            out += [response.token for response in batch.step()]
    return out, counts[0], counts[1]


def test_a_draft_model_whose_drafts_are_mostly_rejected_still_gives_greedy_tokens(
    tmp_path: Path, default_models: dict[str, Path]
) -> None:
    """A random draft model of another seed: its drafts are mostly rejected, so both caches
    roll back step after step (the target's by the verify step, the draft's by its shared
    prefix), and the answer is still single-device mlx-lm's, twice over (a second stream).
    The prompt is longer than the draft model reads in a step: it drafts once caught up."""
    from mlx_lm import load, stream_generate

    from exo_tp.models.draft import load_draft

    smollm2 = default_models["smollm2-135m"]
    target_dir = write_tiny_model(tmp_path / "target", tiny_config("llama"), smollm2)
    draft_dir = write_tiny_model(tmp_path / "draft", tiny_config("llama"), smollm2, seed=1)
    reference, tokenizer = load(str(target_dir))
    reference.set_dtype(mx.float32)
    # longer than FEED_CHUNK: the draft model catches up over plain steps first
    prompt = [258, 85, 252, 17, 301] * 60
    expected, margins = [], []
    for response in stream_generate(reference, tokenizer, mx.array(prompt), max_tokens=16):
        expected.append(response.token)
        top2 = sorted(response.logprobs.astype(mx.float32).tolist())[-2:]
        margins.append(top2[1] - top2[0])
    plan = plan_tensor_parallel(load_spec(target_dir), [1.0])
    target = load_shard(target_dir, plan, 0, mx.distributed.init(), mx.float32)
    eos = list(tokenizer.eos_token_ids)
    tokens, drafted, accepted = _draft_decode(
        target, load_draft(draft_dir, mx.float32), prompt, 16, eos
    )
    decided = next((i for i, m in enumerate(margins) if m < MIN_MARGIN), len(expected))
    assert drafted > 0 and drafted - accepted > drafted // 2, (drafted, accepted)
    assert (
        tokens[:decided] == expected[:decided] and tokens[16 : 16 + decided] == expected[:decided]
    )
    # the target drafting for itself: every draft kept (the same float32 computation)
    same, drafted, accepted = _draft_decode(
        target, load_draft(target_dir, mx.float32), prompt, 16, eos
    )
    assert same == tokens and drafted > 0 and accepted == drafted, (drafted, accepted)


def test_a_draft_model_with_another_tokenizer_is_refused_in_one_line(
    tmp_path: Path, default_models: dict[str, Path]
) -> None:
    """A draft model whose tokenizer maps two ids the other way round: refused before any rank
    starts, in one line naming the flag."""
    import json

    smollm2, draft = default_models["smollm2-135m"], tmp_path / "draft"
    draft.mkdir()
    for item in smollm2.iterdir():  # SmolLM2 itself, but for its tokenizer
        if item.name == "tokenizer.json":
            continue
        (draft / item.name).symlink_to(item)
    tokenizer = json.loads((smollm2 / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (draft / "tokenizer.json").write_text(json.dumps(tokenizer))
    result = run_cli(
        "launch",
        "--ranks",
        "2",
        "--model",
        "smollm2-135m",
        "--prompt",
        "hi",
        "--max-tokens",
        "2",
        "--draft-model",
        str(draft),
        check=False,
    )
    assert result.returncode != 0 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--draft-model" in lines[0] and "tokenizer" in lines[0], lines
    assert "about 2 ids mapped otherwise" in lines[0], lines


@pytest.mark.parametrize(
    ("stages", "weights", "drafter"),
    [
        # overlapped stages (one lane each): the earlier stage reads the verify step's tokens
        # at once instead of a round later
        ("2,1", [0.6, 0.4, 1.0], ("--num-draft-tokens", str(DRAFTS))),
        # one batch in flight; the earlier stage takes the model's drafts from a message
        ("1,2", [1.0, 0.6, 0.4], ("--draft-model", "DRAFT", "--no-overlap")),
    ],
    ids=["prompt-lookup-overlapped", "draft-model-one-in-flight"],
)
def test_pipeline_stages_verify_drafts_and_give_greedy_tokens(
    tmp_path: Path,
    reference: Reference,
    stages: str,
    weights: list[float],
    drafter: tuple[str, ...],
) -> None:
    """Two pipeline stages verify k + 1 positions in one forward across the hop, and both
    roll back what the target rejected: the answer is single-device mlx-lm's."""
    extra = [_model_dir() if a == "DRAFT" else a for a in drafter]
    result = launch(tmp_path, "smollm2-135m", weights, PROMPT, TOKENS, "--stages", stages, *extra)
    report = result.report
    assert report.accepted_tokens > 0, report
    if "--num-draft-tokens" in extra:  # prompt lookup drafts wrongly too: rollbacks happen
        assert report.drafted_tokens > report.accepted_tokens, report
    assert list(report.tokens) == reference.tokens


def test_a_node_cluster_drafts_with_the_4_bit_model(reference: Reference) -> None:
    """`exo-tp run --draft-model smollm2-135m-q4` on 2 uneven local nodes: a greedy chat
    request is answered with single-device mlx-lm's text (the float32 model's), its usage
    reports the 4-bit model's drafts the float32 model kept, and the cluster view names the
    node the draft runs on."""
    from cluster_helpers import http_json, local_cluster

    extra = ("--draft-model", "smollm2-135m-q4")
    with local_cluster(2, weights=[0.6, 0.4], extra=extra) as cluster:
        body = {
            "model": "smollm2-135m",
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": TOKENS,
            "temperature": 0,
        }
        status, answer = http_json(cluster.urls[0] + "/v1/chat/completions", body, timeout=300)
        _, view = http_json(cluster.urls[0] + "/v1/cluster")
    assert status == 200, answer
    # the cluster view says where the draft runs: the conductor's node, rank 0's
    assert view["serving"]["draft_model"] == "smollm2-135m-q4"
    assert view["serving"]["draft_node"] == view["ranks"][0], view["serving"]
    assert answer["choices"][0]["message"]["content"] == reference.text
    details = answer["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0, answer["usage"]


def test_the_planner_counts_the_4_bit_drafts_8_bit_embedding() -> None:
    """The 4-bit SmolLM2's config keeps its embedding (its tied head too) at 8 bits: the draft's
    weights in the plan equal what the conductor holds once it loads the draft, to the byte."""
    from mlx.utils import tree_flatten

    from exo_tp.models.draft import load_draft
    from exo_tp.models.registry import resolve_model
    from exo_tp.plan.draft import draft_cost

    folder = resolve_model("smollm2-135m-q4")
    held = sum(v.nbytes for _, v in tree_flatten(load_draft(folder, mx.float32).parameters()))
    assert draft_cost(load_spec(folder), "q4").weights == held


def test_plan_shows_the_draft_model_beside_the_conductor() -> None:
    """`exo-tp plan --draft-model`: where the draft runs, its weights as mlx-lm holds them
    (float32), and its KV cache per 1k tokens as mlx-lm's KVCache holds it."""
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache

    from exo_tp.plan.human import size

    model, _ = _single_device(_model_dir())
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    cache = make_prompt_cache(model)
    model(mx.zeros((1, 1024), dtype=mx.int32), cache=cache)
    kv = sum(c.nbytes for c in cache) * 1000 // 1024  # 1,024: no slack in its steps of 256
    out = run_cli("plan", "--weights", "3,2", "--draft-model", "smollm2-135m").stdout
    line = next(x for x in out.splitlines() if x.startswith("draft model"))
    assert "beside rank 0 (the conductor)" in line, line
    assert f"{size(weights)} of weights, {size(kv)} of KV cache per 1k tokens" in line, line
    # a quantized KV cache never speculates: the draft is not loaded, nor counted
    quantized = run_cli(
        "plan", "--weights", "3,2", "--kv-bits", "8", "--draft-model", "smollm2-135m"
    ).stdout
    drafts = [x for x in quantized.splitlines() if x.startswith("draft model")]
    assert drafts == [
        "draft model smollm2-135m: not loaded (a quantized KV cache does not speculate)"
    ]
