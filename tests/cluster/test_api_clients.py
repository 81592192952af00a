"""Real clients against a real 2-node cluster: the official openai and anthropic SDKs and
langchain-openai, every answer compared with what single-device mlx-lm (and mlx_lm.server's own
prompt rendering and tool parsing) computes for the same request (tests/api_reference.py).

The cluster serves SmolLM2 with a tool-capable chat template (tests/tool_model.py) and
non-default server-side defaults, so a request that omits a field shows which default it got.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import pytest
from api_reference import Generated, Sampling, SingleDevice
from cluster_helpers import LocalCluster, http_json, local_cluster
from openai import OpenAI
from tool_model import write_tool_model

TEMPLATE_ARGS = {"system_note": "Be brief."}
SERVER_DEFAULTS = (
    "--temp",
    "0.7",
    "--top-k",
    "5",
    "--max-tokens",
    "7",
    "--chat-template-args",
    json.dumps(TEMPLATE_ARGS),
)
STORY = [{"role": "user", "content": "Tell me a story about a dragon."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
REPEAT_CALL = [{"role": "user", "content": f"Repeat exactly: {CALL_TEXT}"}]
LOGPROB_ATOL = 1e-3  # fp32: a row-parallel split reorders sums (see helpers.assert_logits_close)


@pytest.fixture(scope="module")
def model_dir(default_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tool_model(
        tmp_path_factory.mktemp("tool-model") / "smollm2-tools", default_models["smollm2-135m"]
    )


@pytest.fixture(scope="module")
def cluster(model_dir: Path) -> Iterator[LocalCluster]:
    with local_cluster(
        2, weights=[0.6, 0.4], model=str(model_dir), extra=SERVER_DEFAULTS
    ) as running:
        yield running


@pytest.fixture(scope="module")
def ref(model_dir: Path) -> SingleDevice:
    return SingleDevice(model_dir, TEMPLATE_ARGS)


def _openai(cluster: LocalCluster, node: int = 0) -> OpenAI:
    return OpenAI(base_url=f"{cluster.urls[node]}/v1", api_key="unused", max_retries=0, timeout=300)


def _ids(logprobs: Any) -> list[int]:
    return [entry.id for entry in logprobs.content]  # mlx_lm.server's extra field


# ---- sampling --------------------------------------------------------------------------------

TOKENS = 8  # generated per sampling request (the penalties first change token 7)
GREEDY_FIRST = 504  # "The": the greedy first token of the story (checked in the test)
SAMPLING_CASES = {
    # name: (request fields, the same in mlx_lm.server's terms)
    "top_k=1 at temperature 2 is greedy": (
        {"temperature": 2.0, "top_k": 1, "seed": 1},
        Sampling(temperature=2.0, top_k=1, seed=1),
    ),
    "seed": ({"temperature": 1.0, "seed": 5}, Sampling(temperature=1.0, seed=5)),
    "top_p": (
        {"temperature": 1.0, "top_p": 0.5, "seed": 5},
        Sampling(temperature=1.0, top_p=0.5, seed=5),
    ),
    "min_p": (
        {"temperature": 1.0, "min_p": 0.2, "seed": 5},
        Sampling(temperature=1.0, min_p=0.2, seed=5),
    ),
    "top_k": (
        {"temperature": 1.0, "top_k": 3, "seed": 5},
        Sampling(temperature=1.0, top_k=3, seed=5),
    ),
    "xtc": (
        {"temperature": 1.0, "xtc_probability": 1.0, "xtc_threshold": 0.1, "seed": 5},
        Sampling(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.1, seed=5),
    ),
    "repetition_penalty": (
        {"temperature": 0, "repetition_penalty": 1.8, "repetition_context_size": 5},
        Sampling(repetition_penalty=1.8, repetition_context_size=5),
    ),
    "presence_penalty": (
        {"temperature": 0, "presence_penalty": 3.0, "presence_context_size": 10},
        Sampling(presence_penalty=3.0, presence_context_size=10),
    ),
    "frequency_penalty": (
        {"temperature": 0, "frequency_penalty": 2.0, "frequency_context_size": 10},
        Sampling(frequency_penalty=2.0, frequency_context_size=10),
    ),
    "logit_bias": (
        {"temperature": 0, "logit_bias": {str(GREEDY_FIRST): -100}},
        Sampling(logit_bias={GREEDY_FIRST: -100}),
    ),
}
OPENAI_FIELDS = {
    "temperature",
    "top_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
}


@pytest.fixture(scope="module")
def story(ref: SingleDevice) -> tuple[list[int], list[int]]:
    """The story prompt as mlx_lm.server renders it, and its greedy answer."""
    prompt = ref.chat_tokens(STORY)
    greedy = ref.generate(prompt, TOKENS).tokens
    assert greedy[0] == GREEDY_FIRST
    return prompt, greedy


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_sampling_parameter_matches_mlx_lm(
    cluster: LocalCluster, ref: SingleDevice, story: tuple[list[int], list[int]], case: str
) -> None:
    sampling = SAMPLING_CASES[case][1]
    prompt, greedy = story
    expected = ref.generate(prompt, TOKENS, sampling).tokens
    if case.startswith("top_k=1"):
        assert expected == greedy
    elif sampling.temperature == 0:
        assert expected != greedy  # the parameter changes the answer
    else:  # the filter changes the answer that the same seed gives without it
        plain = ref.generate(
            prompt, TOKENS, Sampling(temperature=sampling.temperature, seed=sampling.seed)
        ).tokens
        assert case == "seed" or expected != plain
    tokens, text = _sampled(cluster, case)
    assert tokens == expected
    assert text == ref.tokenizer.decode(expected)


def _sampled(cluster: LocalCluster, case: str) -> tuple[list[int], str]:
    """The story's answer from the cluster with a sampling case's fields (tokens, text)."""
    fields = {"top_k": 0, **SAMPLING_CASES[case][0]}  # the cluster's default top_k is 5
    reply = _openai(cluster).chat.completions.create(
        model="default_model",
        messages=STORY,
        max_tokens=TOKENS,
        logprobs=True,
        **{k: v for k, v in fields.items() if k in OPENAI_FIELDS},
        extra_body={k: v for k, v in fields.items() if k not in OPENAI_FIELDS},
    )
    return _ids(reply.choices[0].logprobs), reply.choices[0].message.content or ""


def test_sampling_parameters_apply_per_sequence_in_one_batch(
    cluster: LocalCluster, ref: SingleDevice, story: tuple[list[int], list[int]]
) -> None:
    """Requests with different parameters sent at once decode in one batch; each gets what
    single-device mlx-lm gives it alone (rank 0 samples every row with its own sampler,
    processors and seeded random stream)."""
    prompt, _ = story
    cases = ["seed", "top_k", "min_p", "repetition_penalty", "logit_bias"]
    expected = {
        case: ref.generate(prompt, TOKENS, SAMPLING_CASES[case][1]).tokens for case in cases
    }
    with ThreadPoolExecutor(len(cases)) as pool:
        got = dict(
            zip(cases, pool.map(lambda case: _sampled(cluster, case)[0], cases), strict=True)
        )
    assert got == expected


@pytest.mark.parametrize("endpoint", ["chat-stream", "completions", "completions-stream"])
def test_sampling_on_every_endpoint(
    cluster: LocalCluster, ref: SingleDevice, story: tuple[list[int], list[int]], endpoint: str
) -> None:
    """Completions take the prompt as token ids; a stream carries the same tokens."""
    prompt, _ = story
    fields, sampling = SAMPLING_CASES["min_p"]
    expected = ref.generate(prompt, TOKENS, sampling)
    client = _openai(cluster, node=1)
    common = {
        "max_tokens": TOKENS,
        "temperature": fields["temperature"],
        "seed": fields["seed"],
        "extra_body": {"min_p": fields["min_p"], "top_k": 0},
    }
    if endpoint == "chat-stream":
        chunks = list(
            client.chat.completions.create(
                model="default_model", messages=STORY, logprobs=True, stream=True, **common
            )
        )
        ids = [
            i
            for c in chunks
            if c.choices and c.choices[0].logprobs
            for i in _ids(c.choices[0].logprobs)
        ]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    elif endpoint == "completions":
        reply = client.completions.create(
            model="default_model", prompt=prompt, logprobs=0, **common
        )
        text = reply.choices[0].text
        ids = ref.tokenizer.encode(
            "".join(reply.choices[0].logprobs.tokens), add_special_tokens=False
        )
    else:
        chunks = list(
            client.completions.create(model="default_model", prompt=prompt, stream=True, **common)
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        ids = ref.tokenizer.encode(text, add_special_tokens=False)
    assert text == expected.text
    assert ids == ref.tokenizer.encode(expected.text, add_special_tokens=False)


def test_omitted_fields_take_the_server_defaults(
    cluster: LocalCluster, ref: SingleDevice, story: tuple[list[int], list[int]]
) -> None:
    """`exo-tp run --temp 0.7 --top-k 5 --max-tokens 7 --chat-template-args ...`: a request
    without those fields samples as mlx_lm.server with the same flags (not at temperature 1,
    not unbounded)."""
    prompt, _ = story
    expected = ref.generate(prompt, 7, Sampling(temperature=0.7, top_k=5, seed=11))
    code, reply = http_json(
        f"{cluster.urls[1]}/v1/chat/completions", {"messages": STORY, "seed": 11}, timeout=300
    )
    assert code == 200, reply
    assert reply["choices"][0]["message"]["content"] == expected.text
    assert reply["usage"]["prompt_tokens"] == len(prompt)  # the template argument is in it
    assert reply["usage"]["completion_tokens"] == len(expected.tokens)


# ---- logprobs --------------------------------------------------------------------------------


def test_logprobs_equal_single_device(
    cluster: LocalCluster, ref: SingleDevice, story: tuple[list[int], list[int]]
) -> None:
    prompt, _ = story
    expected = ref.generate(prompt, TOKENS, top_logprobs=5)
    client = _openai(cluster)
    request: dict[str, Any] = {
        "model": "default_model",
        "messages": STORY,
        "max_tokens": TOKENS,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 5,
    }
    reply = client.chat.completions.create(**request)
    content = reply.choices[0].logprobs.content
    assert [e.id for e in content] == expected.tokens
    for entry, logprob, top in zip(content, expected.logprobs, expected.top, strict=True):
        assert entry.logprob == pytest.approx(logprob, abs=LOGPROB_ATOL)
        assert [t.id for t in entry.top_logprobs] == [i for i, _ in top]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            [lp for _, lp in top], abs=LOGPROB_ATOL
        )
        assert bytes(entry.bytes).decode() == entry.token == ref.tokenizer.decode([entry.id])
    chunks = list(client.chat.completions.create(**request, stream=True))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.id, e.logprob) for e in streamed] == [(e.id, e.logprob) for e in content]
    legacy = client.completions.create(
        model="default_model", prompt=prompt, max_tokens=TOKENS, temperature=0, logprobs=3
    )
    assert legacy.choices[0].logprobs.token_logprobs == pytest.approx(
        expected.logprobs, abs=LOGPROB_ATOL
    )
    assert [list(t) for t in legacy.choices[0].logprobs.top_logprobs] == [
        [ref.tokenizer.decode([i]) for i, _ in top[:3]] for top in expected.top
    ]
    assert "".join(legacy.choices[0].logprobs.tokens) == legacy.choices[0].text


# ---- tools -----------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "You help with the weather."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 25 C"},
]


def test_tool_conversation_renders_as_mlx_lm_server(
    cluster: LocalCluster, ref: SingleDevice
) -> None:
    """Tools, an assistant's tool call and a tool result reach the prompt exactly as
    mlx_lm.server renders them: same prompt length, same answer, same log-probabilities."""
    prompt = ref.chat_tokens(CONVERSATION, [WEATHER])
    rendered = ref.tokenizer.decode(prompt)
    assert "<tool_response>\nSunny, 25 C" in rendered and '"arguments": {"city"' in rendered
    expected = ref.generate(prompt, 6)
    reply = _openai(cluster, node=1).chat.completions.create(
        model="default_model",
        messages=CONVERSATION,
        tools=[WEATHER],
        max_tokens=6,
        temperature=0,
        logprobs=True,
    )
    assert reply.usage.prompt_tokens == len(prompt)
    assert _ids(reply.choices[0].logprobs) == expected.tokens
    assert [e.logprob for e in reply.choices[0].logprobs.content] == pytest.approx(
        expected.logprobs, abs=LOGPROB_ATOL
    )
    # tool_choice "none" offers no tools: the prompt is the one without them
    bare = _openai(cluster).chat.completions.create(
        model="default_model",
        messages=CONVERSATION[:2],
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=1,
        temperature=0,
    )
    assert bare.usage.prompt_tokens == len(ref.chat_tokens(CONVERSATION[:2]))


@pytest.fixture(scope="module")
def repeated(ref: SingleDevice) -> Generated:
    """SmolLM2 asked to repeat a tool call, as single-device mlx-lm answers (greedy)."""
    return ref.generate(ref.chat_tokens(REPEAT_CALL, [WEATHER]), 36, top_logprobs=1)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_tool_call_is_parsed_as_mlx_lm_parses_it(
    cluster: LocalCluster, ref: SingleDevice, repeated: Generated, stream: bool
) -> None:
    """SmolLM2 repeats a tool call in the template's format; it comes back as the tool_calls
    mlx-lm's parser reads from the same text, with finish_reason "tool_calls"."""
    text = repeated.text.split("\n\n")[0]  # the stop sequence below
    content, calls = ref.tool_calls(text, [WEATHER])
    assert calls == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    request = {
        "model": "default_model",
        "messages": REPEAT_CALL,
        "tools": [WEATHER],
        "max_tokens": 40,
        "temperature": 0,
        "stop": ["\n\n"],
    }
    client = _openai(cluster, node=int(stream))
    if stream:
        chunks = list(client.chat.completions.create(**request, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        got = [
            {"name": t.function.name, "arguments": json.loads(t.function.arguments)}
            for d in deltas
            for t in d.tool_calls or []
        ]
        assert [t.index for d in deltas for t in d.tool_calls or []] == [0]
        got_content = "".join(d.content or "" for d in deltas)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        reply = client.chat.completions.create(**request)
        message = reply.choices[0].message
        got = [
            {"name": t.function.name, "arguments": json.loads(t.function.arguments)}
            for t in message.tool_calls
        ]
        assert all(t.id and t.type == "function" for t in message.tool_calls)
        got_content, finish = message.content or "", reply.choices[0].finish_reason
    assert got == calls
    assert got_content == content
    assert finish == "tool_calls"


def _prompt_scores(
    ref: SingleDevice, ids: list[int], top: int
) -> tuple[list[float], list[dict[str, float]]]:
    """Single-device mlx-lm's log-softmax of each prompt token after the ones before it, and
    the ``top`` most likely tokens there (their text as the API keys them)."""
    import mlx.core as mx

    logits = ref.model(mx.array(ids)[None])[0].astype(mx.float32)
    scores = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = [scores[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    tops = []
    for i in range(len(ids) - 1):
        best = mx.argsort(-scores[i])[:top].tolist()
        tops.append({ref.tokenizer.decode([t]): scores[i, t].item() for t in best})
    return chosen, tops  # type: ignore[return-value]


def test_prompt_logprobs_equal_single_device(cluster: LocalCluster, ref: SingleDevice) -> None:
    """What lm-eval's local-completions sends: several prompts, echo, logprobs, max_tokens 0
    (scored only) and 2 (scored, then generated): each prompt token's log-probability (the
    first null) and its top 3 equal mlx-lm's log-softmax, the vocabulary never gathered."""
    prompts = ["The capital of France is Paris.", "Once upon a time, a small dragon"]
    client = _openai(cluster)
    reply = client.completions.create(
        model="default_model", prompt=prompts, max_tokens=0, echo=True, logprobs=3, temperature=0
    )
    assert [c.index for c in reply.choices] == [0, 1]
    for prompt, choice in zip(prompts, reply.choices, strict=True):
        ids = ref.tokenizer.encode(prompt)
        chosen, tops = _prompt_scores(ref, ids, 3)
        scored = choice.logprobs
        assert choice.text == prompt and scored is not None
        assert scored.tokens == [ref.tokenizer.decode([t]) for t in ids]
        assert scored.token_logprobs[0] is None and scored.top_logprobs[0] is None  # type: ignore[index]
        assert scored.token_logprobs[1:] == pytest.approx(chosen, abs=LOGPROB_ATOL)
        for got, want in zip(scored.top_logprobs[1:], tops, strict=True):  # type: ignore[index]
            assert list(got) == list(want)
            assert list(got.values()) == pytest.approx(list(want.values()), abs=LOGPROB_ATOL)
    ids = ref.tokenizer.encode(prompts[0])
    expected = ref.generate(ids, 2, top_logprobs=1)
    reply = client.completions.create(
        model="default_model", prompt=[ids], max_tokens=2, echo=True, logprobs=1, temperature=0
    )
    choice = reply.choices[0]
    assert choice.text == prompts[0] + expected.text
    assert choice.logprobs is not None and len(choice.logprobs.token_logprobs) == len(ids) + 2
    assert choice.logprobs.token_logprobs[1 : len(ids)] == pytest.approx(
        _prompt_scores(ref, ids, 1)[0], abs=LOGPROB_ATOL
    )
    assert choice.logprobs.token_logprobs[len(ids) :] == pytest.approx(
        expected.logprobs, abs=LOGPROB_ATOL
    )
    assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_speculation_keeps_logprobs_and_tool_calls_and_survives_a_cancel(
    cluster: LocalCluster, ref: SingleDevice, stream: bool
) -> None:
    """The repeated tool call with drafts looked up in the prompt (the request's
    num_draft_tokens): most drafts are kept, and the tokens, their logprobs and top 5, the
    parsed tool call and the finish are single-device mlx-lm's, as without drafts. Then a
    drafting stream dropped by its client after a few chunks: the next request still gets
    mlx-lm's answer (the verify steps' caches were rolled back and freed with it)."""
    expected = ref.generate(ref.chat_tokens(REPEAT_CALL, [WEATHER]), 36, top_logprobs=5)
    content, calls = ref.tool_calls(expected.text.split("\n\n")[0], [WEATHER])
    request: dict[str, Any] = {
        "model": "default_model",
        "messages": REPEAT_CALL,
        "tools": [WEATHER],
        "max_tokens": 36,
        "temperature": 0,
        "stop": ["\n\n"],
        "logprobs": True,
        "top_logprobs": 5,
        "extra_body": {"num_draft_tokens": 4},
    }
    client = _openai(cluster, node=int(stream))
    if stream:
        chunks = list(
            client.chat.completions.create(
                **request, stream=True, stream_options={"include_usage": True}
            )
        )
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        got = [
            {"name": t.function.name, "arguments": json.loads(t.function.arguments)}
            for d in deltas
            for t in d.tool_calls or []
        ]
        got_content = "".join(d.content or "" for d in deltas)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        entries = [
            e
            for c in chunks
            if c.choices and c.choices[0].logprobs
            for e in c.choices[0].logprobs.content or []
        ]
        usage = chunks[-1].usage
    else:
        reply = client.chat.completions.create(**request)
        message = reply.choices[0].message
        got = [
            {"name": t.function.name, "arguments": json.loads(t.function.arguments)}
            for t in message.tool_calls or []
        ]
        got_content, finish = message.content or "", reply.choices[0].finish_reason
        entries = list(reply.choices[0].logprobs.content or [])
        usage = reply.usage
    details = usage.completion_tokens_details if usage else None
    assert details is not None and (details.accepted_prediction_tokens or 0) > 10, usage
    assert (got, got_content, finish) == (calls, content, "tool_calls")
    assert len(entries) > 10 and [e.id for e in entries] == expected.tokens[: len(entries)]
    for entry, logprob, top in zip(entries, expected.logprobs, expected.top, strict=False):
        assert entry.logprob == pytest.approx(logprob, abs=LOGPROB_ATOL)
        assert [t.id for t in entry.top_logprobs] == [i for i, _ in top]
    dropped = client.chat.completions.create(**request, stream=True)
    for seen, _ in enumerate(dropped):
        if seen == 3:
            break
    dropped.close()
    again = client.chat.completions.create(**request)
    assert [
        {"name": t.function.name, "arguments": json.loads(t.function.arguments)}
        for t in again.choices[0].message.tool_calls or []
    ] == calls
    again_ids = [e.id for e in again.choices[0].logprobs.content or []]
    assert again_ids == [e.id for e in entries]


# ---- Anthropic Messages API ------------------------------------------------------------------


def _anthropic(cluster: LocalCluster, node: int = 0) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=cluster.urls[node], api_key="unused", max_retries=0, timeout=300
    )


def test_anthropic_messages(cluster: LocalCluster, ref: SingleDevice) -> None:
    """System prompt, several turns, max_tokens, stop_sequences and temperature (sent as
    older SDKs send it: the current SDK dropped the argument)."""
    turns = [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the capital of "},
                {"type": "text", "text": "France?"},
            ],
        },
    ]
    chat = [
        {"role": "system", "content": "You are terse."},
        turns[0],
        turns[1],
        {"role": "user", "content": "What is the capital of France?"},
    ]
    prompt = ref.chat_tokens(chat)
    expected = ref.generate(prompt, 12)
    client = _anthropic(cluster, node=1)
    reply = client.messages.create(
        model="default_model",
        max_tokens=12,
        system="You are terse.",
        messages=turns,
        extra_body={"temperature": 0},
    )
    assert [b.type for b in reply.content] == ["text"]
    assert reply.content[0].text == expected.text
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == len(prompt)
    assert reply.usage.output_tokens == len(expected.tokens)
    assert reply.stop_reason == ("end_turn" if expected.finish_reason == "stop" else "max_tokens")
    word = expected.text.split()[2]
    with client.messages.stream(
        model="default_model",
        max_tokens=12,
        system="You are terse.",
        messages=turns,
        stop_sequences=[f" {word}"],
        extra_body={"temperature": 0},
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
    } <= set(kinds)
    assert final.content[0].text == expected.text.split(f" {word}")[0]
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", f" {word}")
    short = client.messages.create(
        model="default_model",
        max_tokens=2,
        messages=turns,
        system="You are terse.",
        extra_body={"temperature": 0},
    )
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2
    assert client.messages.count_tokens(
        model="default_model", system="You are terse.", messages=turns
    ).input_tokens == len(prompt)


def test_anthropic_tool_use_and_result(cluster: LocalCluster, ref: SingleDevice) -> None:
    tool = {
        "name": "get_weather",
        "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"],
    }
    client = _anthropic(cluster)
    with client.messages.stream(
        model="default_model",
        max_tokens=40,
        messages=REPEAT_CALL,
        tools=[tool],
        stop_sequences=["\n\n"],
        extra_body={"temperature": 0},
    ) as stream:
        called = stream.get_final_message()
    uses = [b for b in called.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [("get_weather", {"city": "Paris"})]
    assert called.stop_reason == "tool_use"
    follow_up = [
        *REPEAT_CALL,
        {"role": "assistant", "content": called.content},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny, 25 C"}
            ],
        },
    ]
    reply = client.messages.create(
        model="default_model",
        max_tokens=3,
        messages=follow_up,
        tools=[tool],
        extra_body={"temperature": 0},
    )
    chat = [
        *REPEAT_CALL,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": uses[0].id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": uses[0].id, "content": "Sunny, 25 C"},
    ]
    prompt = ref.chat_tokens(chat, [WEATHER])
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == len(prompt)
    assert reply.content[0].text == ref.generate(prompt, 3).text


# ---- a framework client, model views, request ids, refusals ----------------------------------


def test_langchain_openai(cluster: LocalCluster, ref: SingleDevice) -> None:
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=f"{cluster.urls[1]}/v1",
        api_key="unused",
        model="default_model",
        temperature=0,
        max_tokens=8,
        max_retries=0,
        timeout=300,
    )
    answer = llm.invoke([HumanMessage(content=STORY[0]["content"])])
    assert answer.content == ref.generate(ref.chat_tokens(STORY), 8).text
    called = llm.bind_tools([WEATHER]).invoke(
        REPEAT_CALL[0]["content"], stop=["\n\n"], max_tokens=40
    )
    assert [(c["name"], c["args"]) for c in called.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]


def test_models_aliases_and_request_ids(cluster: LocalCluster, model_dir: Path) -> None:
    client = _openai(cluster, node=1)
    listed = client.models.list().data
    assert [m.id for m in listed] == [str(model_dir)]
    assert client.models.retrieve(str(model_dir)).id == str(model_dir)
    assert client.models.retrieve("default_model").id == str(model_dir)
    code, body = http_json(f"{cluster.urls[1]}/v1/models/gpt-4o")
    assert code == 404 and body["error"]["code"] == "model_not_found"
    request = urllib.request.Request(
        f"{cluster.urls[1]}/chat/completions",
        json.dumps({"messages": STORY, "max_tokens": 1, "temperature": 0}).encode(),
        {"Content-Type": "application/json", "X-Request-Id": "trace-42"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        reply = json.loads(response.read())
        assert response.headers["x-request-id"] == "trace-42"
    assert reply["system_fingerprint"].startswith("exo-tp-")
    with urllib.request.urlopen(f"{cluster.urls[0]}/models", timeout=30) as response:
        assert json.loads(response.read())["data"][0]["id"] == str(model_dir)
        assert response.headers["x-request-id"].startswith("req_")


REFUSED = [
    ("n", {"n": 17}),
    ("response_format.type", {"response_format": {"type": "xml"}}),
    (  # an image for a model without a vision tower
        "messages[0].content[1]",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    ],
                }
            ]
        },
    ),
    ("audio", {"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"]}),
    ("functions", {"functions": [WEATHER["function"]]}),
    (
        "tool_choice",
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
    ),
    ("logit_bias", {"logit_bias": {"49152": 5}}),
    ("best_of_the_rest", {"best_of_the_rest": 1}),
]


@pytest.mark.parametrize(("param", "extra"), REFUSED, ids=[r[0] for r in REFUSED])
def test_what_the_cluster_cannot_do_is_a_400_naming_it(
    cluster: LocalCluster, param: str, extra: dict[str, Any]
) -> None:
    body = {"messages": STORY, "max_tokens": 1, **extra}
    code, reply = http_json(f"{cluster.urls[0]}/v1/chat/completions", body, timeout=60)
    assert code == 400, reply
    assert reply["error"]["param"] == param, reply


# ---- the web UI ------------------------------------------------------------------------------

READ_ANSWER = """
const answers = document.querySelectorAll('#messages .message.assistant');
const last = answers[answers.length - 1];
return last ? {state: last.dataset.state, text: last.querySelector('.content').textContent,
  calls: [...last.querySelectorAll('.tool-call')].map(
    (c) => ({name: c.dataset.name, args: c.querySelector('.tool-args').textContent})),
  logprobs: [...last.querySelectorAll('.content .token')].map((t) => Number(t.dataset.logprob))}
  : null;
"""


def test_web_chat_shows_tool_calls_and_logprobs(
    cluster: LocalCluster, ref: SingleDevice, repeated: Generated
) -> None:
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    from test_web_ui import CHROME_FLAGS, CHROMEDRIVER, CHROMIUM

    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("needs Debian's chromium and chromium-driver")
    content, calls = ref.tool_calls(repeated.text, [WEATHER])
    assert calls and content
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        driver.get(cluster.urls[1] + "/")
        driver.find_element(By.CSS_SELECTOR, ".chat-tools summary").click()
        for field, value in (
            ("chat-temperature", "0"),
            ("chat-max-tokens", "36"),
            ("chat-tools", json.dumps([WEATHER])),
            ("chat-input", REPEAT_CALL[0]["content"]),  # typed, its newlines would send it
        ):
            driver.execute_script(
                "arguments[0].value = arguments[1]", driver.find_element(By.ID, field), value
            )
        driver.find_element(By.ID, "chat-logprobs").click()
        driver.find_element(By.ID, "chat-send").click()
        shown = WebDriverWait(driver, 300, poll_frequency=0.2).until(
            lambda d: (
                (d.execute_script(READ_ANSWER) or {}).get("state") in ("done", "error")
                and d.execute_script(READ_ANSWER)
            )
        )
        assert shown["state"] == "done", shown
        assert [
            {"name": c["name"], "arguments": json.loads(c["args"])} for c in shown["calls"]
        ] == calls
        assert shown["text"] == content
        # each token of the text after the call shows its log-probability: mlx-lm's
        tail = repeated.logprobs[len(repeated.logprobs) - len(shown["logprobs"]) :]
        assert shown["logprobs"] and shown["logprobs"] == pytest.approx(tail, abs=LOGPROB_ATOL)
        token = driver.find_elements(By.CSS_SELECTOR, "#messages .content .token")[-1]
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", token)
        ActionChains(driver).move_to_element(token).perform()
        tip = driver.find_element(By.ID, "tooltip")
        WebDriverWait(driver, 10).until(lambda d: tip.is_displayed())
        assert "logprob" in tip.text and "%" in tip.text
        assert len(tip.text.splitlines()) >= 1 + 5  # the token and its top alternatives
    finally:
        driver.quit()
