"""Images across uneven nodes (issue #58): tiny Qwen 3.5 and Gemma 4 vision checkpoints
(tests/vlm_models.py) served by 3 local nodes with shares 5, 3 and 1, each answer compared with
single-device mlx-vlm `stream_generate` for the same message rendered by its own chat template:
through the openai and anthropic SDKs, streamed and not, beside a text stream, from the prompt
cache and past it; and every kind of bad image a 400 naming its part."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import ollama
import pytest
from cluster_helpers import LocalCluster, http_json, local_cluster
from openai import OpenAI

pytest.importorskip("mlx_vlm", reason="mlx-vlm is not installed (.ci/install installs it)")
from vlm_models import (  # noqa: E402
    FAMILIES,
    PROMPT,
    TOKENS,
    gradient,
    greedy,
    greedy_text,
    write_tiny_vlm,
)

pytestmark = pytest.mark.filterwarnings("ignore:At least one mel filter:UserWarning")
STORY = "Tell me a story."


def png(image: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(image: Any) -> str:
    return "data:image/png;base64," + base64.b64encode(png(image)).decode()


def image_message(shade: int, text: str = PROMPT) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": data_url(gradient(shade))}},
            {"type": "text", "text": text},
        ],
    }


class Served:
    def __init__(self, cluster: LocalCluster, folder: Path):
        from mlx_vlm import load

        self.cluster, self.folder = cluster, folder
        self.model, self.processor = load(str(folder))
        self._refs: dict[Any, list[int]] = {}

    def ref(self, shade: int | None, prompt: str = PROMPT) -> list[int]:
        key = (shade, prompt)
        if key not in self._refs:
            image = gradient(shade) if shade is not None else None
            self._refs[key] = greedy(self.model, self.processor, image, prompt=prompt)
        return self._refs[key]

    def text(self, tokens: list[int]) -> str:
        """mlx-lm's chat answer of ``tokens`` (its streaming detokenizer drops the answer's
        leading space, as mlx_lm.server does; mlx-vlm's keeps it)."""
        from mlx_lm.tokenizer_utils import load as load_tokenizer

        detokenizer = load_tokenizer(self.folder).detokenizer
        for token in tokens:
            detokenizer.add_token(token)
        detokenizer.finalize()
        return detokenizer.text

    def openai(self) -> OpenAI:
        url = f"{self.cluster.urls[0]}/v1"
        return OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module", params=FAMILIES)
def served(
    request: pytest.FixtureRequest,
    default_models: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Served]:
    family = request.param
    folder = tmp_path_factory.mktemp("vlm") / family
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_OFFLINE", "1")  # the processors read the folder, never the hub
        write_tiny_vlm(folder, family, default_models["smollm2-135m"])
        with local_cluster(3, weights=[5, 3, 1], model=str(folder)) as cluster:
            yield Served(cluster, folder)


def _ids(choice: Any) -> list[int]:
    return [entry.id for entry in choice.logprobs.content]  # mlx_lm.server's extra field


def _chat(served: Served, messages: list[dict[str, Any]], stream: bool) -> list[int]:
    client = served.openai()
    options: dict[str, Any] = dict(max_tokens=TOKENS, temperature=0, logprobs=True)
    if not stream:
        reply = client.chat.completions.create(model="m", messages=messages, **options)  # type: ignore[call-overload]
        return _ids(reply.choices[0])
    ids: list[int] = []
    for chunk in client.chat.completions.create(
        model="m", messages=messages, stream=True, **options
    ):  # type: ignore[call-overload]
        if chunk.choices and chunk.choices[0].logprobs:
            ids += _ids(chunk.choices[0])
    return ids


@pytest.mark.parametrize("stream", [False, True])
def test_openai_sdk_answers_as_mlx_vlm(served: Served, stream: bool) -> None:
    assert _chat(served, [image_message(1)], stream) == served.ref(1)


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_sdk_answers_as_mlx_vlm(served: Served, stream: bool) -> None:
    client = anthropic.Anthropic(base_url=served.cluster.urls[0], api_key="unused", max_retries=0)
    image = {
        "type": "image",
        "source": {
            "type": "base64",
            "media_type": "image/png",
            "data": base64.b64encode(png(gradient(3))).decode(),
        },
    }
    messages = [{"role": "user", "content": [image, {"type": "text", "text": PROMPT}]}]
    options: dict[str, Any] = dict(model="m", max_tokens=TOKENS, messages=messages)
    options["extra_body"] = {"temperature": 0}  # (this SDK's signature lacks it)
    if stream:
        with client.messages.stream(**options) as events:
            text = "".join(events.text_stream)
    else:
        reply = client.messages.create(**options)
        text = "".join(block.text for block in reply.content if block.type == "text")
    assert text == served.text(served.ref(3))


def test_responses_and_ollama_take_images_as_mlx_vlm(served: Served) -> None:
    expected = served.text(served.ref(3))
    encoded = base64.b64encode(png(gradient(3))).decode()
    reply = served.openai().responses.create(
        model="m",
        input=[  # type: ignore[list-item]
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(gradient(3)), "detail": "auto"},
                    {"type": "input_text", "text": PROMPT},
                ],
            }
        ],
        max_output_tokens=TOKENS,
        temperature=0,
    )
    assert reply.output_text == expected
    client = ollama.Client(host=served.cluster.urls[1], timeout=300)
    said = client.chat(
        "m",
        messages=[{"role": "user", "content": PROMPT, "images": [encoded]}],
        options={"temperature": 0, "num_predict": TOKENS},
    )
    assert said.message.content == expected
    listed = http_json(f"{served.cluster.urls[0]}/v1/models")[1]["data"]
    assert listed[0]["capabilities"] == ["vision"]
    shown = client.show(listed[0]["id"])
    assert "vision" in (shown.capabilities or [])


def test_image_streams_batched_together_and_beside_a_text_stream(served: Served) -> None:
    """Three images and a text at once: prompts prefilled side by side, rows decoded in one
    batch, each its own registry span."""
    text_message = {"role": "user", "content": STORY}
    with ThreadPoolExecutor(4) as pool:
        images = {
            shade: pool.submit(_chat, served, [image_message(shade)], True) for shade in (5, 6, 7)
        }
        text = pool.submit(_chat, served, [text_message], True)
        for shade, answer in images.items():
            assert answer.result() == served.ref(shade)
        assert text.result() == served.ref(None, STORY)


def test_an_image_stream_batched_beside_a_text_stream(served: Served) -> None:
    text_message = {"role": "user", "content": STORY}
    with ThreadPoolExecutor(2) as pool:
        image = pool.submit(_chat, served, [image_message(5)], True)
        text = pool.submit(_chat, served, [text_message], True)
        assert image.result() == served.ref(5)
        assert text.result() == served.ref(None, STORY)


def test_stop_strings_structured_output_and_a_cancel_with_an_image(served: Served) -> None:
    """An image request stops at a stop string as mlx-vlm's text would, decodes under a JSON
    schema, and one dropped mid-stream leaves the next answered as mlx-vlm's."""
    client = served.openai()
    whole = served.text(served.ref(1))
    stop = whole[len(whole) // 2 : len(whole) // 2 + 3]
    reply = client.chat.completions.create(
        model="m",
        messages=[image_message(1)],
        max_tokens=TOKENS,
        temperature=0,
        stop=[stop],  # type: ignore[list-item]
    )
    assert reply.choices[0].message.content == whole[: whole.index(stop)]
    assert reply.choices[0].finish_reason == "stop"
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    shaped = client.chat.completions.create(
        model="m",
        messages=[image_message(2)],  # type: ignore[list-item]
        max_tokens=30,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "v", "schema": schema}},
    )
    assert isinstance(json.loads(shaped.choices[0].message.content or "")["ok"], bool)
    dropped = client.chat.completions.create(
        model="m",
        messages=[image_message(4)],
        max_tokens=200,
        temperature=0,
        stream=True,  # type: ignore[list-item]
    )
    for seen, _ in enumerate(dropped):
        if seen == 2:
            break
    dropped.close()
    assert _chat(served, [image_message(1)], False) == served.ref(1)


def test_the_prompt_cache_hits_by_image_and_misses_by_another(served: Served) -> None:
    """A next turn extends the first turn's entry (prompt and answer), its image's span
    registered under the same ids again: a hit, and the answer is mlx-vlm's for the whole
    conversation; the same turn with another image misses from the image on. (These models'
    sliding-window and recurrent caches cannot be trimmed, so an entry serves only prompts
    that extend it, for text as for images: exo_tp.runtime.prompt_cache.)"""
    client = served.openai()

    def ask(messages: list[dict[str, Any]], tokens: int) -> tuple[list[int], str, int]:
        reply = client.chat.completions.create(
            model="m",
            messages=messages,
            max_tokens=tokens,
            temperature=0,
            logprobs=True,  # type: ignore[arg-type]
        )
        details = reply.usage.prompt_tokens_details if reply.usage else None
        cached = details.cached_tokens if details and details.cached_tokens else 0
        return _ids(reply.choices[0]), reply.choices[0].message.content or "", cached

    def turns(shade: int, answer: str) -> list[dict[str, Any]]:
        return [
            image_message(shade),
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "More?"},
        ]

    first, _, _ = ask([image_message(9)], 1)  # its entry: the prompt and its one answer token
    said = served.processor.tokenizer.decode(first)  # the answer as it encodes back to itself
    ids, _, hit = ask(turns(9, said), TOKENS)
    assert hit > 0
    rendered = served.processor.tokenizer.apply_chat_template(
        [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]},
            {"role": "assistant", "content": said},
            {"role": "user", "content": "More?"},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert ids == greedy_text(served.model, served.processor, rendered, [gradient(9)])
    other, _, miss = ask(turns(11, said), TOKENS)
    assert miss == 0
    assert other == greedy_text(served.model, served.processor, rendered, [gradient(11)])


def _bomb() -> bytes:
    from PIL import Image

    return png(Image.new("L", (9000, 6000)))  # 54 million pixels, a few KB compressed


BAD_IMAGES: list[tuple[str, str, str]] = [
    ("not base64", "data:image/png;base64,@@@@", "base64"),
    (
        "not an image",
        "data:image/png;base64," + base64.b64encode(b"hello").decode(),
        "not a supported",
    ),
    (
        "truncated",
        "data:image/png;base64," + base64.b64encode(png(gradient(1))[:100]).decode(),
        "decoded",
    ),
    ("bomb", "data:image/png;base64," + base64.b64encode(_bomb()).decode(), "million pixels"),
    ("url", "https://example.com/cat.png", "not fetched"),
    ("svg", "data:image/svg+xml;base64," + base64.b64encode(b"<svg/>").decode(), "not a supported"),
]


@pytest.mark.parametrize(("what", "url", "words"), BAD_IMAGES, ids=[b[0] for b in BAD_IMAGES])
def test_a_bad_image_is_a_400_naming_its_part(
    served: Served, what: str, url: str, words: str
) -> None:
    message = {
        "role": "user",
        "content": [
            {"type": "text", "text": "Look:"},
            {"type": "image_url", "image_url": {"url": url}},
        ],
    }
    body = {"messages": [message], "max_tokens": 1}
    code, reply = http_json(f"{served.cluster.urls[1]}/v1/chat/completions", body, timeout=60)
    assert code == 400, reply
    assert reply["error"]["param"].startswith("messages[0].content[1]"), reply
    assert words in reply["error"]["message"], reply


def test_too_many_images_is_a_400_and_the_cluster_serves_on(served: Served) -> None:
    parts = [{"type": "image_url", "image_url": {"url": data_url(gradient(1, 32, 32))}}] * 17
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 1}
    code, reply = http_json(f"{served.cluster.urls[0]}/v1/chat/completions", body, timeout=60)
    assert code == 400 and "Too many images" in reply["error"]["message"], reply
    assert _chat(served, [image_message(1)], False) == served.ref(1)
