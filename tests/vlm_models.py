"""Tiny random vision-language checkpoints, written offline the way mlx-vlm saves and loads them.

The random weights come from mlx-vlm's own model classes (its vision tower, projector and
language model) and are saved with mlx-vlm's own ``save_weights``/``save_config``, so the folder
is what ``mlx_vlm.convert`` leaves (parameters as mlx-vlm holds them: ``language_model.model.*``,
``vision_tower.*``, ``embed_vision.*``). Beside them the files each family's torch-free
processor reads offline (docs/vision.md): the SmolLM2 tokenizer cut to the model's vocabulary
with the family's image tokens added at its end, a chat template that places an image, and the
processor configs (Qwen-VL asks the hub for any of its three that is missing).

- ``qwen3_5``: Qwen 3.5 (dense) with its Qwen3-VL vision tower; the text model is the
  architecture matrix's ``qwen3_5`` (tests/arch_configs.py: Gated DeltaNet and gated attention
  layers, M-RoPE sections [2, 3, 3]).
- ``gemma4``: Gemma 4 with its vision tower and ``audio_config`` null (else mlx-vlm builds the
  default audio tower); the text model is the matrix's ``gemma4_text`` (2B/4B-like: two head
  widths, KV sharing, per-layer input embeddings).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
from arch_configs import ARCHS
from mlx.utils import tree_flatten
from tiny_models import write_tokenizer

Family = Literal["qwen3_5", "gemma4"]
FAMILIES: tuple[Family, ...] = ("qwen3_5", "gemma4")
VOCAB = 512
# Multiplicative parameters, drawn near 1 (as in tests/tiny_models.py).
_NEAR_ONE = ("norm.weight", "norm1.weight", "norm2.weight", "layer_scalar")
# Gemma scales its (tied) embeddings by sqrt(hidden): drawn at 0.08 like the rest, a token's own
# logit stood ~5 sigma above the others and greedy decoding repeated the prompt's last token.
_SMALL = {"gemma4": ("language_model.model.embed_tokens.weight",)}
_END = "<|im_end|>"  # SmolLM2's own turn tokens (ids 1 and 2), kept by the cut vocabulary

# The family's special tokens, appended at the end of the vocabulary (ids VOCAB - n ... VOCAB - 1).
_SPECIALS: dict[str, list[str]] = {
    "qwen3_5": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
    "gemma4": ["<|image>", "<|image|>", "<image|>", "<|audio|>", "<|video|>"],
}


def _template(image: str) -> str:
    """A ChatML template (SmolLM2's turn tokens) whose content lists may hold images."""
    return (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}{{ '\\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        f"{{% if part['type'] == 'image' %}}{image}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}<|im_end|>{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
    )


def _ids(family: Family) -> dict[str, int]:
    first = VOCAB - len(_SPECIALS[family])
    return {token: first + i for i, token in enumerate(_SPECIALS[family])}


def _qwen3_5_config() -> dict[str, Any]:
    text = copy.deepcopy(ARCHS["qwen3_5"]["text_config"])
    text.update(vocab_size=VOCAB, eos_token_id=2)
    ids = _ids("qwen3_5")
    vision = dict(
        model_type="qwen3_5",
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        out_hidden_size=text["hidden_size"],
        num_heads=2,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=64,
        deepstack_visual_indexes=[],
    )
    return dict(
        model_type="qwen3_5",
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        vocab_size=VOCAB,
        eos_token_id=2,
        tie_word_embeddings=True,
    )


# Gemma 4's image: at most this many soft tokens (pooled 3x3 patches of 16 pixels).
GEMMA4_SOFT_TOKENS = 16


def _gemma4_config() -> dict[str, Any]:
    text = copy.deepcopy(ARCHS["gemma4_text"])
    text.update(vocab_size=VOCAB, rms_norm_eps=1e-6, max_position_embeddings=512)
    # Explicit, as Gemma 4 checkpoints ship it: the libraries' defaults differ (mlx-lm rotates a
    # quarter of a global head, mlx-vlm all of it; docs/vision.md).
    text["rope_parameters"] = {
        "full_attention": {
            "partial_rotary_factor": 0.25,
            "rope_theta": 1000000.0,
            "rope_type": "proportional",
        },
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
    }
    ids = _ids("gemma4")
    vision = dict(
        model_type="gemma4_vision",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=16,
        patch_size=16,
        pooling_kernel_size=3,
        position_embedding_size=64,
        default_output_length=GEMMA4_SOFT_TOKENS,
    )
    return dict(
        model_type="gemma4",
        text_config=text,
        vision_config=vision,
        audio_config=None,
        vocab_size=VOCAB,
        hidden_size=text["hidden_size"],
        boi_token_id=ids["<|image>"],
        image_token_id=ids["<|image|>"],
        eoi_token_id=ids["<image|>"],
        audio_token_id=ids["<|audio|>"],
        video_token_id=ids["<|video|>"],
        vision_soft_tokens_per_image=GEMMA4_SOFT_TOKENS,
        eos_token_id=[2],
        tie_word_embeddings=True,
    )


def vlm_config(family: Family) -> dict[str, Any]:
    """The checkpoint's config.json (vision_config and text_config nested)."""
    return _qwen3_5_config() if family == "qwen3_5" else _gemma4_config()


def _processor_files(family: Family) -> dict[str, dict[str, Any]]:
    if family == "qwen3_5":
        image = {
            "patch_size": 16,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "size": {"shortest_edge": 32 * 32, "longest_edge": 128 * 128},
        }
        return {
            "preprocessor_config.json": {**image, "image_processor_type": "Qwen2VLImageProcessor"},
            "video_preprocessor_config.json": image,
            "processor_config.json": {"processor_class": "Qwen3VLProcessor"},
        }
    image = {
        "patch_size": 16,
        "max_soft_tokens": GEMMA4_SOFT_TOKENS,
        "pooling_kernel_size": 3,
        "do_normalize": False,
    }
    return {
        "processor_config.json": {"processor_class": "Gemma4Processor", "image_processor": image}
    }


def _tokenizer_config(family: Family) -> dict[str, Any]:
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": _END,
        "pad_token": _END,
        "unk_token": None,
        "model_max_length": 512,
    }
    if family == "qwen3_5":
        config["extra_special_tokens"] = {
            "image_token": "<|image_pad|>",
            "video_token": "<|video_pad|>",
            "vision_start_token": "<|vision_start|>",
            "vision_end_token": "<|vision_end|>",
        }
    else:
        config["extra_special_tokens"] = {
            "boi_token": "<|image>",
            "image_token": "<|image|>",
            "eoi_token": "<image|>",
            "audio_token": "<|audio|>",
            "video_token": "<|video|>",
        }
    return config


def _write_tokenizer(folder: Path, family: Family, tokenizer_from: Path) -> None:
    """SmolLM2's BPE cut below the family's special tokens, which take the last ids."""
    ids = _ids(family)
    path = folder / "tokenizer.json"
    write_tokenizer(path, tokenizer_from / "tokenizer.json", min(ids.values()))
    tokenizer = json.loads(path.read_text())
    tokenizer["added_tokens"] += [
        {
            "id": i,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for token, i in ids.items()
    ]
    path.write_text(json.dumps(tokenizer))
    (folder / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(family)))
    image = "<|vision_start|><|image_pad|><|vision_end|>" if family == "qwen3_5" else "<|image|>"
    (folder / "chat_template.jinja").write_text(_template(image))


def write_tiny_vlm(folder: Path, family: Family, tokenizer_from: Path, seed: int = 0) -> Path:
    """A tiny random ``family`` checkpoint in ``folder`` (float32, a few MB), with the SmolLM2
    tokenizer files of ``tokenizer_from`` cut to its vocabulary."""
    from mlx_vlm.utils import (
        get_model_and_args,
        save_config,
        save_weights,
        update_module_configs,
    )

    folder.mkdir(parents=True, exist_ok=True)
    config = vlm_config(family)
    module, _ = get_model_and_args(config)
    # The model's config as mlx_vlm.load builds it (the nested configs as their classes).
    model_config = module.ModelConfig.from_dict(copy.deepcopy(config))
    nested = ["text", "vision", "perceiver", "projector", "audio"]
    model = module.Model(update_module_configs(model_config, module, config, nested))
    mx.random.seed(seed)
    params = []
    for name, value in tree_flatten(model.parameters()):
        if not mx.issubdtype(value.dtype, mx.floating):
            params.append((name, value))
        elif name.endswith(_NEAR_ONE):
            params.append((name, 1.0 + 0.1 * mx.random.normal(value.shape)))
        elif name in _SMALL.get(family, ()):
            params.append((name, 0.02 * mx.random.normal(value.shape)))
        else:
            params.append((name, 0.08 * mx.random.normal(value.shape)))
    model.load_weights(params)
    save_weights(folder, model)
    save_config(config, folder / "config.json")
    for name, content in _processor_files(family).items():
        (folder / name).write_text(json.dumps(content))
    _write_tokenizer(folder, family, tokenizer_from)
    return folder


TOKENS = 16  # compared greedy tokens: M-RoPE errors show after a few
PROMPT = "Describe the image."


def gradient(shade: int, width: int = 96, height: int = 64) -> Any:
    """An RGB image: horizontal and vertical ramps, a third channel set by ``shade``."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack(
        [x * 255 // (width - 1), y * 255 // (height - 1), (x + y) * shade % 256], axis=-1
    )
    return Image.fromarray(pixels.astype(np.uint8))


def greedy(
    model: Any, processor: Any, image: Any, tokens: int = TOKENS, prompt: str = PROMPT
) -> list[int]:
    """Single-device mlx-vlm: the greedy tokens for one image and ``prompt``, rendered by its own
    chat template (the reference a cluster serving images is compared with)."""
    from mlx_vlm.prompt_utils import apply_chat_template

    text = apply_chat_template(processor, model.config, prompt, num_images=1 if image else 0)
    return greedy_text(model, processor, text, [image] if image is not None else [], tokens)


def greedy_text(
    model: Any, processor: Any, text: str, images: list[Any], tokens: int = TOKENS
) -> list[int]:
    """Single-device mlx-vlm's greedy tokens for a rendered prompt and its images."""
    from mlx_vlm import stream_generate

    by_position: dict[int, int] = {}  # the last response repeats the last token
    for response in stream_generate(
        model, processor, text, image=images or None, max_tokens=tokens, temperature=0.0
    ):
        by_position[response.generation_tokens] = response.token
    return [by_position[i] for i in sorted(by_position)]
