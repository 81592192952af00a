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
- ``gemma3``: Gemma 3 with its SigLIP tower (64-pixel images, 4 soft tokens each); the text
  model is the matrix's ``gemma3_text`` (one KV head, sliding window 8 on every other layer),
  its head tied as Google ships it: the file holds no ``lm_head`` (mlx-vlm's Gemma 3 loads the
  embedding as its head whatever the file holds; mlx-lm ties it where the file has none).
- ``qwen3_vl``: Qwen3-VL (dense) with deepstack: the tower's features of both its blocks are
  added after text layers 0 and 1; the text model is the matrix's ``qwen3_vl`` (Qwen 3, M-RoPE
  sections [8, 12, 12]).
- ``qwen3_5_moe``: Qwen 3.5 MoE, the same tower and processor as ``qwen3_5``; the text model is
  the matrix's ``qwen3_5_moe``.
- ``mistral3``: Mistral 3 with its Pixtral tower (a 96x64 image: 3x2 [IMG] tokens, an
  [IMG_BREAK] after each row but the last, an [IMG_END]); the text model is the matrix's
  ``mistral3`` (Ministral 3 under ``text_config``).
- ``kimi_k25``: Kimi K2.5 with its MoonViT tower; the text model is the matrix's ``kimi_k25``
  (DeepSeek V3: MLA, a dense layer then a MoE one) narrowed to hidden 256.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
from arch_configs import ARCHS, tiny_config
from mlx.utils import tree_flatten
from tiny_models import write_tokenizer

Family = Literal["qwen3_5", "gemma4", "gemma3", "qwen3_vl", "qwen3_5_moe", "mistral3", "kimi_k25"]
# The families every image test runs (tests/cluster/test_vision.py serves these on 3 nodes)...
FAMILIES: tuple[Family, ...] = ("qwen3_5", "gemma4")
# ... and all of them, checked on local ranks against mlx-vlm (tests/ranks/test_vlm_*.py).
ALL_FAMILIES: tuple[Family, ...] = (*FAMILIES, "gemma3", "qwen3_vl", "qwen3_5_moe", "mistral3")
ALL_FAMILIES += ("kimi_k25",)
VOCAB = 512
# Multiplicative parameters, drawn near 1 (as in tests/tiny_models.py).
_NEAR_ONE = ("norm.weight", "norm1.weight", "norm2.weight", "layer_scalar")
# Gemma scales its (tied) embeddings by sqrt(hidden): drawn at 0.08 like the rest, a token's own
# logit stood ~5 sigma above the others and greedy decoding repeated the prompt's last token
# (Gemma 3, wider, still repeated at 0.02).
_EMBED = "language_model.model.embed_tokens.weight"
_SMALL: dict[str, dict[str, float]] = {"gemma4": {_EMBED: 0.02}, "gemma3": {_EMBED: 0.01}}
_END = "<|im_end|>"  # SmolLM2's own turn tokens (ids 1 and 2), kept by the cut vocabulary

# The family's special tokens, appended at the end of the vocabulary (ids VOCAB - n ... VOCAB - 1).
_QWEN_VL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
_SPECIALS: dict[str, list[str]] = {
    "qwen3_5": _QWEN_VL,
    "qwen3_vl": _QWEN_VL,
    "qwen3_5_moe": _QWEN_VL,
    "gemma4": ["<|image>", "<|image|>", "<image|>", "<|audio|>", "<|video|>"],
    "gemma3": ["<start_of_image>", "<end_of_image>", "<image_soft_token>"],
    "mistral3": ["[IMG]", "[IMG_BREAK]", "[IMG_END]"],
    "kimi_k25": ["<|media_start|>", "<|media_pad|>", "<|media_end|>"],
}
# The tokenizer's names of those tokens (the processors read them as its attributes).
_NAMED: dict[str, dict[str, str]] = {
    "qwen3_5": {
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
        "vision_start_token": "<|vision_start|>",
        "vision_end_token": "<|vision_end|>",
    },
    "gemma4": {
        "boi_token": "<|image>",
        "image_token": "<|image|>",
        "eoi_token": "<image|>",
        "audio_token": "<|audio|>",
        "video_token": "<|video|>",
    },
    "gemma3": {
        "boi_token": "<start_of_image>",
        "image_token": "<image_soft_token>",
        "eoi_token": "<end_of_image>",
    },
}
_NAMED["qwen3_vl"] = _NAMED["qwen3_5_moe"] = _NAMED["qwen3_5"]
# Where each family's chat template puts an image (Gemma 3's prompt holds its own token).
_IMAGE_IN_TEMPLATE = {
    "qwen3_5": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen3_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen3_5_moe": "<|vision_start|><|image_pad|><|vision_end|>",
    "gemma4": "<|image|>",
    "gemma3": "<start_of_image>",
    "mistral3": "[IMG]",  # the processor writes each row's [IMG]s, [IMG_BREAK]s and [IMG_END]
    "kimi_k25": "<|media_start|><|media_pad|><|media_end|>",
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


_QWEN = ("qwen3_5", "qwen3_vl", "qwen3_5_moe")  # the Qwen3-VL tower and processor


def _qwen_config(family: Family) -> dict[str, Any]:
    """Qwen 3.5 (dense, MoE) or Qwen3-VL: the same Qwen3-VL tower (deepstack for Qwen3-VL
    only)."""
    text = copy.deepcopy(ARCHS[family]["text_config"])
    text.update(vocab_size=VOCAB, eos_token_id=2)
    ids = _ids(family)
    vision = dict(
        model_type=family,
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        out_hidden_size=text["hidden_size"],
        num_heads=2,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=64,
        deepstack_visual_indexes=[0, 1] if family == "qwen3_vl" else [],
    )
    return dict(
        model_type=family,
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


# Gemma 3's image: 64 pixels, 4x4 patches of 16 pooled 2x2 into this many soft tokens.
GEMMA3_SOFT_TOKENS = 4


def _gemma3_config() -> dict[str, Any]:
    text = tiny_config("gemma3_text")
    # rope_theta as Gemma 3 ships it: mlx-vlm's global layers take rope_global_base_freq (1e6 by
    # default), mlx-lm's rope_theta.
    text.update(
        vocab_size=VOCAB,
        mm_tokens_per_image=GEMMA3_SOFT_TOKENS,
        rope_theta=1000000.0,
        rope_global_base_freq=1000000.0,
    )
    ids = _ids("gemma3")
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        patch_size=16,
        image_size=64,
    )
    return dict(
        model_type="gemma3",
        text_config=text,
        vision_config=vision,
        vocab_size=VOCAB,
        # mlx-vlm divides the image features by sqrt(hidden_size) (default 2048): the text's
        hidden_size=text["hidden_size"],
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
        eos_token_id=[2],
    )


def vlm_config(family: Family) -> dict[str, Any]:
    """The checkpoint's config.json (vision_config and text_config nested)."""
    if family in _QWEN:
        return _qwen_config(family)
    if family in ("mistral3", "kimi_k25"):
        return _mistral3_config() if family == "mistral3" else _kimi_k25_config()
    return _gemma4_config() if family == "gemma4" else _gemma3_config()


def _mistral3_config() -> dict[str, Any]:
    """Mistral 3: Pixtral's tower (16-pixel patches merged 2x2: a token per 32x32 pixels),
    Ministral 3's text model (the matrix's ``mistral3``)."""
    text = dict(copy.deepcopy(ARCHS["mistral3"]["text_config"]), vocab_size=VOCAB)
    vision = dict(model_type="pixtral", num_hidden_layers=2, num_attention_heads=2, head_dim=16)
    vision.update(hidden_size=32, intermediate_size=64, image_size=128, patch_size=16)
    image = _ids("mistral3")["[IMG]"]
    return _nested("mistral3", text, vision, image_token_index=image, spatial_merge_size=2)


def _kimi_k25_config() -> dict[str, Any]:
    """Kimi K2.5: MoonViT (14-pixel patches merged 2x2), DeepSeek V3's text model (the matrix's
    ``kimi_k25`` narrowed: 5 MLA heads, layer 0 dense, layer 1 4 experts top 2 + a shared one)."""
    text = copy.deepcopy(ARCHS["kimi_k25"]["text_config"])
    text.update(vocab_size=VOCAB, hidden_size=256, q_lora_rank=64, kv_lora_rank=64)
    text.update(qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
    vision = dict(model_type="moonvit", depth=2, num_heads=2, patch_size=14, embed_dim=32)
    vision.update(hidden_size=32, intermediate_size=64, merge_kernel_size=[2, 2])
    vision.update(init_pos_emb_height=8, init_pos_emb_width=8)
    image = _ids("kimi_k25")["<|media_pad|>"]
    return _nested("kimi_k25", text, vision, media_placeholder_token_id=image)


def _nested(family: Family, text: dict[str, Any], vision: dict[str, Any], **more: Any) -> Any:
    """config.json of ``family`` nesting its text and vision configs."""
    more.update(vocab_size=VOCAB, eos_token_id=[2])
    return dict(model_type=family, text_config=text, vision_config=vision, **more)


def _processor_files(family: Family) -> dict[str, dict[str, Any]]:
    normal = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    if family == "mistral3":
        image = {"size": {"longest_edge": 96}, "patch_size": 16, **normal}
        kinds = ("image_token", "image_break_token", "image_end_token")
        names = dict(zip(kinds, _ids(family), strict=True))
        return {
            "preprocessor_config.json": {**image, "image_processor_type": "PixtralImageProcessor"},
            "processor_config.json": {"processor_class": "PixtralProcessor", **names},
        }
    if family == "kimi_k25":
        media = {"patch_size": 14, "in_patch_limit": 64, "merge_kernel_size": [2, 2], **normal}
        return {"preprocessor_config.json": {"media_proc_cfg": media}}
    if family == "gemma3":
        image = {
            "image_processor_type": "Gemma3ImageProcessor",
            "size": {"height": 64, "width": 64},
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "do_pan_and_scan": False,
        }
        processor = {"processor_class": "Gemma3Processor", "image_seq_length": GEMMA3_SOFT_TOKENS}
        return {"preprocessor_config.json": image, "processor_config.json": processor}
    if family in _QWEN:
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
        "extra_special_tokens": _NAMED.get(family, {}),
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
    (folder / "chat_template.jinja").write_text(_template(_IMAGE_IN_TEMPLATE[family]))


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
        elif name in _SMALL.get(family, {}):
            params.append((name, _SMALL[family][name] * mx.random.normal(value.shape)))
        else:
            params.append((name, 0.08 * mx.random.normal(value.shape)))
    model.load_weights(params)
    if family == "gemma3":
        model.language_model.pop("lm_head")  # tied (module doc)
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
