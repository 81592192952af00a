"""Serving many users at once on real clusters: continuous batching on every rank in lockstep,
the prompt cache, cancellation, load and failures (issue #11).

Every text is compared with single-device mlx-lm generating that prompt alone. The clusters
serve SmolLM2's tokenizer and head groups on tiny random weights (the ``tiny_smollm2`` fixture):
batching, caching and exactness do not depend on the weights, and SmolLM2's own took this
module's decoding ~10x longer.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from cluster_helpers import LocalCluster, http_json, local_cluster, wait_ready
from helpers import greedy_batch, mlx_lm_reference
from openai import APIError, BadRequestError, OpenAI, RateLimitError

MODEL = "default_model"  # the name in requests: the cluster serves one model, whatever its name
# The tiny model's float32 KV cache per token of context: 4 layers x keys and values x 3 KV
# heads x 16
KV_BYTES_PER_TOKEN = 4 * 2 * 3 * 16 * 4
KV_CAP_TOKENS = 3000
TOKENS = 12
PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue, as if I were five years old and curious.",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "Describe a cat in exactly one short sentence, mentioning its whiskers, its tail and "
    "its favourite place to sleep in the afternoon sun.",
    "Which planet is known as the red planet?",
]


@pytest.fixture(scope="module")
def references(tiny_smollm2: Path) -> dict[str, str]:
    return {p: mlx_lm_reference(tiny_smollm2, p, TOKENS).text for p in PROMPTS}


@pytest.fixture(scope="module")
def tp_cluster(tiny_smollm2: Path) -> Iterator[LocalCluster]:
    extra = ("--max-concurrency", "8")
    with local_cluster(3, weights=[5, 3, 2], model=str(tiny_smollm2), extra=extra) as running:
        yield running


@pytest.fixture(scope="module")
def hybrid_cluster(tiny_smollm2: Path) -> Iterator[LocalCluster]:
    """A single-rank stage, then a tensor-parallel last stage of 2 ranks, overlapped (the
    default): both last-stage ranks sample and must agree on every lane's tokens. The other
    hybrid shape, a tensor-parallel first stage ("2,1"), serves concurrent requests in
    tests/cluster/test_pipeline.py."""
    with local_cluster(
        3,
        weights=[1, 1, 1],
        model=str(tiny_smollm2),
        extra=("--stages", "1,2", "--max-concurrency", "8", "--max-queue", "8"),
    ) as running:
        yield running


@pytest.fixture(scope="module")
def pipeline_cluster(tiny_smollm2: Path) -> Iterator[LocalCluster]:
    """2 stages of 1 rank, overlapped (the default): one micro-batch per stage in flight. Its
    KV memory is capped (--kv-cache-bytes) to 3,000 tokens of the model's whole KV cache, so
    that the stage holding the most layers holds 3,100-6,000 tokens of context: less than the
    model's 8,192 (test_a_context_the_kv_memory_cannot_hold_is_refused_before_any_work)."""
    with local_cluster(
        2,
        weights=[1, 1],
        model=str(tiny_smollm2),
        extra=(
            "--stages",
            "1,1",
            "--max-concurrency",
            "8",
            "--kv-cache-bytes",
            str(KV_CAP_TOKENS * KV_BYTES_PER_TOKEN),
        ),
    ) as running:
        yield running


def client(url: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)


def ask(
    url: str,
    prompt: str,
    stream: bool,
    max_tokens: int = TOKENS,
    history: list[dict[str, str]] | None = None,
) -> tuple[str, dict]:
    """The answer's text and usage, streamed or not, through the official openai client."""
    messages = [*(history or []), {"role": "user", "content": prompt}]
    api = client(url)
    if not stream:
        reply = api.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens
        )
        return reply.choices[0].message.content or "", reply.usage.model_dump()
    text, usage = "", {}
    for chunk in api.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
    return text, usage


def concurrent_answers(url: str) -> dict[str, str]:
    """All prompts at once, each joining 0.4 s after the previous (mid-generation), half of
    them streamed, sent to different nodes."""

    def one(index: int) -> tuple[str, str]:
        time.sleep(0.4 * index)
        return PROMPTS[index], ask(url, PROMPTS[index], stream=index % 2 == 0)[0]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return dict(pool.map(one, range(len(PROMPTS))))


def test_concurrent_requests_on_uneven_tensor_parallel_equal_one_device(
    tp_cluster: LocalCluster, references: dict[str, str]
) -> None:
    answers = concurrent_answers(tp_cluster.urls[1])  # through a non-leader node too
    assert answers == references


def test_concurrent_requests_on_a_hybrid_with_a_tensor_parallel_last_stage_equal_one_device(
    hybrid_cluster: LocalCluster, references: dict[str, str]
) -> None:
    """Requests join both lanes mid-generation; both ranks of the last stage sample each lane
    and must agree on its tokens and on the changes before every visit."""
    answers = concurrent_answers(hybrid_cluster.urls[0])
    assert answers == references


def test_concurrent_requests_on_an_overlapped_pipeline_equal_one_device(
    pipeline_cluster: LocalCluster, references: dict[str, str]
) -> None:
    """Requests join both lanes mid-generation; each stage steps one lane while the other
    stage steps the other."""
    answers = concurrent_answers(pipeline_cluster.urls[0])
    assert answers == references


def test_cached_second_turn_equals_the_uncached_answer(
    tp_cluster: LocalCluster, tiny_smollm2: Path
) -> None:
    url = tp_cluster.urls[0]
    system = {
        "role": "system",
        "content": "You are a geography teacher. Answer briefly and precisely, in one sentence.",
    }
    first, first_usage = ask(url, PROMPTS[0], stream=False, history=[system])
    history = [
        system,
        {"role": "user", "content": PROMPTS[0]},
        {"role": "assistant", "content": first},
    ]
    second, usage = ask(url, "And of Italy?", stream=True, history=history)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    # the whole first prompt, at least (the answer's text may tokenize otherwise when read back)
    assert cached >= first_usage["prompt_tokens"], (first_usage, usage)
    reference = mlx_lm_reference(
        tiny_smollm2,
        "",
        TOKENS,
        chat_template=True,
        messages=[*history, {"role": "user", "content": "And of Italy?"}],
    )
    assert second == reference.text


def _rank_pids(cluster: LocalCluster) -> dict[int, int]:
    """Global rank -> pid of every rank process of the cluster."""
    out = {}
    for proc in psutil.Process(cluster.proc.pid).children(recursive=True):
        cmdline = proc.cmdline()
        if "exo_tp.runtime.rank" in cmdline:
            job = json.loads(Path(cmdline[cmdline.index("exo_tp.runtime.rank") + 1]).read_text())
            out[job["rank"]] = proc.pid
    return out


def test_cancelled_stream_frees_its_slot(hybrid_cluster: LocalCluster) -> None:
    """Eight long streams fill the batch; cancelling one lets a ninth request in at once,
    long before the others (or the cancelled one's max_tokens) end."""
    url = hybrid_cluster.urls[0]
    long_prompt = "Count from 1 to 500, writing every number as a word, separated by commas."
    stop = threading.Event()
    started = threading.Barrier(9)

    def long_stream(cancel_after: int | None) -> int:
        count = 0
        stream = client(url).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": long_prompt}],
            temperature=0,
            max_tokens=1500,
            stream=True,
        )
        first = True
        for _ in stream:
            if first:
                first = False
                started.wait(timeout=300)
            count += 1
            if (cancel_after is not None and count >= cancel_after) or stop.is_set():
                stream.close()  # the client goes away
                break
        return count

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(long_stream, 3 if i == 0 else None) for i in range(8)]
        started.wait(timeout=300)  # all eight are generating
        futures[0].result(timeout=120)
        begin = time.monotonic()
        text, _ = ask(url, PROMPTS[4], stream=False, max_tokens=4)
        took = time.monotonic() - begin
        still_running = sum(not f.done() for f in futures[1:])
        stop.set()
        for future in futures[1:]:
            future.result(timeout=300)
    assert text
    assert still_running == 7, "the ninth request waited for the other streams to end"
    assert took < 60, f"the ninth request took {took:.1f}s"


def test_load_every_request_completes_or_gets_a_429(hybrid_cluster: LocalCluster) -> None:
    """64 at once on a cluster batching 8 with 8 waiting: each completes or gets a 429 with
    Retry-After; none hangs or disappears; the cluster serves normally afterwards."""
    url = hybrid_cluster.urls[0]

    def one(index: int) -> tuple[int, str]:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": PROMPTS[index % 8]}],
            "temperature": 0,
            "max_tokens": 3,
        }
        status, reply = http_json(url + "/v1/chat/completions", body, timeout=600)
        return status, json.dumps(reply)

    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(64)))
    statuses = [status for status, _ in results]
    assert set(statuses) <= {200, 429}, results
    assert statuses.count(200) >= 16  # the batch and the queue
    refusals = [json.loads(reply)["error"] for status, reply in results if status == 429]
    # OpenAI's rate-limit type (its docs' 429 body), not a server error (issue #45)
    assert all(e["code"] == "queue_full" and e["type"] == "requests" for e in refusals), refusals
    assert ask(url, PROMPTS[0], stream=False, max_tokens=4)[0]


def test_killed_worker_fails_every_stream_within_10s_then_the_cluster_serves(
    tp_cluster: LocalCluster, references: dict[str, str]
) -> None:
    url = tp_cluster.urls[0]
    errors: list[tuple[float, str]] = []
    generating = threading.Barrier(9)

    def stream() -> None:
        try:
            chunks = client(url).chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Tell me a long story."}],
                temperature=0,
                max_tokens=2000,
                stream=True,
            )
            first = True
            for _ in chunks:
                if first:
                    first = False
                    generating.wait(timeout=300)
        except APIError as error:
            errors.append((time.monotonic(), str(error)))

    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(stream) for _ in range(16)]  # 8 generating, 8 waiting
        generating.wait(timeout=300)
        victim = _rank_pids(tp_cluster)[1]
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        for future in futures:
            future.result(timeout=60)
    assert len(errors) == 16, errors
    assert max(at for at, _ in errors) - killed < 10, errors
    assert all("generation failed" in text or "not ready" in text for _, text in errors), errors
    wait_ready(tp_cluster.urls, nodes=3)
    assert ask(url, PROMPTS[0], stream=True)[0] == references[PROMPTS[0]]


def test_waiting_prompts_are_prefilled_one_per_step_shortest_first(tiny_smollm2: Path) -> None:
    """Prompts joining together (the conductor applies every waiting Insert at once) get their
    first tokens one step apart, shortest prompt first, and each one's greedy tokens still
    equal single-device mlx-lm's for that prompt alone. In process: one rank's batch."""
    import mlx.core as mx
    from mlx_lm import load

    from exo_tp.wire.runtime import Insert

    model_dir = tiny_smollm2
    model, tokenizer = load(str(model_dir))
    model.set_dtype(mx.float32)
    prompts = [PROMPTS[3], PROMPTS[4], PROMPTS[0]]  # long, short, medium
    ids = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
        for p in prompts
    ]
    batch = greedy_batch(model, tokenizer, prompt_cache_size=0)
    for uid, prompt in enumerate(ids):
        batch.insert(Insert(uid=uid, tokens=tuple(prompt), max_tokens=TOKENS))
    first_step: dict[int, int] = {}
    generated: dict[int, list[int]] = {uid: [] for uid in range(len(ids))}
    while not batch.idle:
        for response in batch.step():
            first_step.setdefault(response.uid, batch.steps)
            generated[response.uid].append(response.token)
    batch.close()
    by_length = sorted(range(len(ids)), key=lambda uid: len(ids[uid]))
    assert sorted(first_step, key=first_step.__getitem__) == by_length
    steps = [first_step[uid] for uid in by_length]
    assert steps[1] - steps[0] == steps[2] - steps[1] == 1, first_step
    for uid, prompt in enumerate(prompts):
        assert generated[uid] == mlx_lm_reference(model_dir, prompt, TOKENS).tokens


def test_a_context_the_kv_memory_cannot_hold_is_refused_before_any_work(
    pipeline_cluster: LocalCluster,
) -> None:
    """The pipeline cluster's KV memory holds 3,100-6,000 tokens (its fixture): a prompt of
    ~6,500 tokens (within the model's 8,192) can never fit and gets a 400; a request whose
    prompt + max_tokens fits alone but not beside a running one gets a 429, until it ends."""
    openai = client(pipeline_cluster.urls[0])
    with pytest.raises(BadRequestError) as never:
        openai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello " * 6500}],
            max_tokens=4,
        )
    assert never.value.status_code == 400
    assert never.value.code == "context_length_exceeded", never.value
    assert "KV cache" in never.value.message
    short = [{"role": "user", "content": "Tell me a long story."}]
    running = openai.chat.completions.create(
        model=MODEL, messages=short, max_tokens=3000, temperature=0, stream=True
    )
    for chunk in running:  # it generates: its context is reserved
        if chunk.choices and chunk.choices[0].delta.content:
            break
    with pytest.raises(RateLimitError) as busy:
        openai.chat.completions.create(model=MODEL, messages=short, max_tokens=3000)
    assert busy.value.code == "kv_cache_full", busy.value
    running.close()  # cancels it: its reservation goes when the cluster has cancelled it
    while True:
        try:
            answer = openai.chat.completions.create(model=MODEL, messages=short, max_tokens=3)
            break
        except RateLimitError:
            continue
    assert answer.choices[0].message.content


def test_a_requests_own_kv_width_is_a_400_naming_the_nodes_flag(
    pipeline_cluster: LocalCluster,
) -> None:
    """A request cannot choose its KV cache's width (docs/api.md, Unsupported fields): mlx-lm's
    names (kv_bits, quantized_kv_start) through the official client's extra_body are a 400
    naming the field and `exo-tp run --kv-bits`, in chat, completions and the Responses API;
    the cluster then still answers."""
    openai = client(pipeline_cluster.urls[0])
    short = [{"role": "user", "content": "Tell me a long story."}]
    asks = [
        lambda extra: openai.chat.completions.create(
            model=MODEL, messages=short, max_tokens=3, extra_body=extra
        ),
        lambda extra: openai.completions.create(
            model=MODEL, prompt="Once", max_tokens=3, extra_body=extra
        ),
        lambda extra: openai.responses.create(model=MODEL, input="Once", extra_body=extra),
    ]
    for ask, field in zip(asks, ("kv_bits", "quantized_kv_start", "kv_bits"), strict=True):
        with pytest.raises(BadRequestError) as width:
            ask({field: 4})
        assert (width.value.code, width.value.param) == ("unsupported_parameter", field)
        assert "exo-tp run --kv-bits" in width.value.message, width.value.message
    assert openai.chat.completions.create(model=MODEL, messages=short, max_tokens=3).choices
