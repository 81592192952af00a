"""A model whose end-of-turn token is listed only in config.json (as Gemma 3 and Llama 3 ship
it) stops there, as single-device mlx-lm does: on local ranks and through every API dialect."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import pytest
from cluster_helpers import LocalCluster, local_cluster
from helpers import Reference, launch, mlx_lm_reference
from openai import OpenAI

PROMPT = "What is the capital of France?"


@pytest.fixture(scope="module")
def stop_model(tiny_smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's tokenizer on tiny random weights with a second stop id in config.json only: a
    token that greedy decoding emits a few tokens into the answer (the tokenizer's own EOS is
    another)."""
    source = tiny_smollm2
    free = mlx_lm_reference(source, PROMPT, 12)
    position = next(i for i in range(3, len(free.tokens)) if free.tokens[i] not in free.tokens[:i])
    folder = tmp_path_factory.mktemp("stop-model") / "smollm2-eot"
    folder.mkdir()
    for file in source.iterdir():
        (folder / file.name).symlink_to(file)
    config = json.loads((source / "config.json").read_text())
    tokenizer_eos = config["eos_token_id"]
    assert free.tokens[position] != tokenizer_eos
    (folder / "config.json").unlink()
    config["eos_token_id"] = [tokenizer_eos, free.tokens[position]]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def ref(stop_model: Path) -> Reference:
    reference = mlx_lm_reference(stop_model, PROMPT, 12)
    # The reference itself must stop early, or this test could not tell the two apart.
    assert 3 <= len(reference.tokens) < 8, reference.tokens
    return reference


def test_launch_stops_at_config_stop_token(
    stop_model: Path, ref: Reference, tmp_path: Path
) -> None:
    ours = launch(tmp_path, stop_model, [0.6, 0.4], PROMPT, 12, logits=False)
    assert ours.text.removesuffix("\n") == ref.text


@pytest.fixture(scope="module")
def cluster(stop_model: Path) -> Iterator[LocalCluster]:
    with local_cluster(2, weights=[0.6, 0.4], model=str(stop_model)) as running:
        yield running


def test_every_dialect_stops_with_finish_reason_stop(cluster: LocalCluster, ref: Reference) -> None:
    client = OpenAI(base_url=f"{cluster.urls[1]}/v1", api_key="unused", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(
        model="default_model", messages=messages, max_tokens=12, temperature=0
    )
    assert chat.choices[0].message.content == ref.text
    assert chat.choices[0].finish_reason == "stop"

    streamed, reasons = "", []
    for chunk in client.chat.completions.create(
        model="default_model", messages=messages, max_tokens=12, temperature=0, stream=True
    ):
        for choice in chunk.choices:
            streamed += choice.delta.content or ""
            reasons += [choice.finish_reason] if choice.finish_reason else []
    assert (streamed, reasons) == (ref.text, ["stop"])

    claude = anthropic.Anthropic(base_url=cluster.urls[0], api_key="unused", max_retries=0)
    message = claude.messages.create(model="default_model", max_tokens=12, messages=messages)
    assert message.content[0].text == ref.text
    assert message.stop_reason == "end_turn"


def test_completions_stop_at_config_stop_token(
    cluster: LocalCluster, ref: Reference, stop_model: Path
) -> None:
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(stop_model)
    templated = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
    )
    # completions continue their prompt: a first token's leading space stays (docs/api.md),
    # where mlx-lm's chat text drops it
    space = " " if tokenizer.decode([ref.tokens[0]]).startswith(" ") else ""
    client = OpenAI(base_url=f"{cluster.urls[0]}/v1", api_key="unused", max_retries=0, timeout=300)
    completion = client.completions.create(
        model="default_model", prompt=templated, max_tokens=12, temperature=0
    )
    assert completion.choices[0].text == space + ref.text
    assert completion.choices[0].finish_reason == "stop"
