"""Build tokenizer.json / tokenizer_config.json from a GGUF's byte-level BPE metadata.

The `tokenizers` library does the tokenizing; this only assembles its pieces the way the original
Hugging Face tokenizer of a GPT-2-style BPE model with digit splitting (SmolLM) is assembled.
(transformers can read GGUF tokenizers too, but only with torch installed.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

_CONTROL = 3  # llama.cpp token type of special tokens
# llama.cpp pre-tokenizer names whose Hugging Face original splits digits one by one.
_DIGIT_SPLITTING = {"smollm", "starcoder", "refact", "smaug-bpe"}


def _token_id(metadata: dict[str, Any], key: str) -> int | None:
    value = metadata.get(key)
    return None if value is None else int(np.array(value).item())


def build_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    if metadata.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError("only byte-level BPE ('gpt2') GGUF tokenizers are supported")
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if metadata.get("tokenizer.ggml.pre") in _DIGIT_SPLITTING:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    types = np.array(metadata["tokenizer.ggml.token_type"])
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i in np.flatnonzero(types == _CONTROL)
    ]
    tokenizer.add_special_tokens(special)
    return tokenizer


def write_tokenizer(metadata: dict[str, Any], folder: Path) -> None:
    tokenizer = build_tokenizer(metadata)
    tokenizer.save(str(folder / "tokenizer.json"))
    tokens = list(metadata["tokenizer.ggml.tokens"])

    def name(key: str) -> str | None:
        index = _token_id(metadata, key)
        return None if index is None else tokens[index]

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(np.array(metadata.get("tokenizer.ggml.add_bos_token", False)).item()),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(np.array(metadata.get("llama.context_length", 2048)).item()),
        "chat_template": metadata.get("tokenizer.chat_template"),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
