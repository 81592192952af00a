"""Embeddings of the served model (issue #59 point 4) on 3 uneven nodes (5, 3, 1): OpenAI's
/v1/embeddings through the openai SDK (float and base64, several inputs, ``dimensions``) and
Ollama's /api/embed through the ollama client equal single-device mlx-lm's final normed hidden
state at the last token, L2-normalized (cosine >= 0.9999 in float32); bad inputs are 400s."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
import ollama
import pytest
from cluster_helpers import LocalCluster, http_json, local_cluster
from mlx_lm import load
from openai import OpenAI

TEXTS = ["The capital of France is Paris.", "Dragons guard their gold.", "x"]


@pytest.fixture(scope="module")
def cluster(tiny_smollm2: Path) -> Iterator[LocalCluster]:
    with local_cluster(3, weights=[5, 3, 1], model=str(tiny_smollm2)) as running:
        yield running


@pytest.fixture(scope="module")
def reference(tiny_smollm2: Path) -> dict[str, np.ndarray]:
    """mlx-lm on one device, float32: the model's last hidden state (after its final norm)."""
    model, tokenizer = load(str(tiny_smollm2))
    model.set_dtype(mx.float32)
    out = {}
    for text in TEXTS:
        ids = tokenizer.encode(text)
        hidden = model.model(mx.array(ids)[None])[0, -1]
        out[text] = np.array(hidden / mx.linalg.norm(hidden))
        out[f"tokens:{text}"] = np.array(len(ids))
    return out


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_openai_embeddings_equal_single_device(
    cluster: LocalCluster, reference: dict[str, np.ndarray]
) -> None:
    client = OpenAI(base_url=f"{cluster.urls[1]}/v1", api_key="unused", max_retries=0)
    reply = client.embeddings.create(model="m", input=TEXTS, encoding_format="float")
    assert [d.index for d in reply.data] == [0, 1, 2]
    for text, item in zip(TEXTS, reply.data, strict=True):
        got = np.array(item.embedding)
        assert abs(np.linalg.norm(got) - 1) < 1e-5
        assert _cosine(got, reference[text]) >= 0.9999
    assert reply.usage.prompt_tokens == sum(int(reference[f"tokens:{t}"]) for t in TEXTS)
    # the SDK asks for base64 by default and decodes it
    decoded = client.embeddings.create(model="m", input=TEXTS[0])
    assert _cosine(np.array(decoded.data[0].embedding), reference[TEXTS[0]]) >= 0.9999
    short = client.embeddings.create(model="m", input=TEXTS[0], dimensions=16)
    cut = reference[TEXTS[0]][:16]
    assert len(short.data[0].embedding) == 16
    assert _cosine(np.array(short.data[0].embedding), cut) >= 0.9999


def test_ollama_embed_equals_single_device(
    cluster: LocalCluster, reference: dict[str, np.ndarray]
) -> None:
    client = ollama.Client(host=cluster.urls[0], timeout=120)
    reply = client.embed(model="m", input=TEXTS[:2])
    for text, vector in zip(TEXTS[:2], reply.embeddings, strict=True):
        assert _cosine(np.array(vector), reference[text]) >= 0.9999
    assert reply.prompt_eval_count and reply.prompt_eval_count > 0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": "hi", "dimensions": 100000}, "dimensions"),
        ({"input": [[10**9]]}, "input"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_bad_embedding_input_is_a_400(cluster: LocalCluster, body: dict, param: str) -> None:
    code, reply = http_json(f"{cluster.urls[0]}/v1/embeddings", body, timeout=60)
    assert code == 400 and reply["error"]["param"] == param, reply
