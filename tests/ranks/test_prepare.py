"""The default models prepared offline from the GGUF in the PyPI package, checked with mlx-lm."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import generate, load

ENGLISH = (
    "The history of the city goes back more than two thousand years. It was founded as a small "
    "fishing village on the banks of the river, and over the centuries it grew into a major "
    "center of trade and culture. Today it is known for its museums, its parks and its lively "
    "markets, which attract visitors from all over the world."
)


def test_config_describes_smollm2(default_models: dict[str, Path]) -> None:
    config = json.loads((default_models["smollm2-135m"] / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert (config["intermediate_size"], config["vocab_size"]) == (1536, 49152)
    assert config["tie_word_embeddings"] is True
    q4 = json.loads((default_models["smollm2-135m-q4"] / "config.json").read_text())
    assert q4["quantization"]["group_size"] == 32 and q4["quantization"]["bits"] == 4
    # Q8_0 token embedding kept at 8 bits rather than requantized.
    assert q4["quantization"]["model.embed_tokens"]["bits"] == 8


def test_tokenizer_has_chat_template_and_special_tokens(default_models: dict[str, Path]) -> None:
    _, tokenizer = load(str(default_models["smollm2-135m-q4"]))
    assert tokenizer.has_chat_template
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == 2
    assert 2 in tokenizer.eos_token_ids
    assert tokenizer.encode("2024", add_special_tokens=False) == [34, 32, 34, 36]  # digit split
    text = "x = 12 + 3;  naïve café"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("name", ["smollm2-135m", "smollm2-135m-q4"])
def test_greedy_capital_of_france(default_models: dict[str, Path], name: str) -> None:
    model, tokenizer = load(str(default_models[name]))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
    )
    text = generate(model, tokenizer, prompt, max_tokens=20)
    assert "Paris" in text


def test_rows_of_q_and_k_are_unpermuted(default_models: dict[str, Path]) -> None:
    """With llama.cpp's rope row order left in, English costs ~3.3 nats/token; right, ~1.9."""
    model, tokenizer = load(str(default_models["smollm2-135m"]))
    ids = mx.array(tokenizer.encode(ENGLISH))[None]
    loss = nn.losses.cross_entropy(model(ids[:, :-1]).astype(mx.float32), ids[:, 1:]).mean()
    assert loss.item() < 2.3


def test_quantized_weights_are_the_ggufs_own(default_models: dict[str, Path]) -> None:
    """The 4-bit folder dequantizes to exactly the float folder (no requantization)."""
    q4 = mx.load(str(default_models["smollm2-135m-q4"] / "model.safetensors"))
    fp = mx.load(str(default_models["smollm2-135m"] / "model.safetensors"))
    for name, bits in (("model.layers.7.self_attn.k_proj", 4), ("model.embed_tokens", 8)):
        assert q4[f"{name}.weight"].dtype == mx.uint32
        dense = mx.dequantize(
            q4[f"{name}.weight"],
            q4[f"{name}.scales"].astype(mx.float32),
            q4[f"{name}.biases"].astype(mx.float32),
            group_size=32,
            bits=bits,
        )
        assert mx.array_equal(dense, fp[f"{name}.weight"]).item()
