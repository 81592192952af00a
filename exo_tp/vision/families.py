"""The vision families the cluster runs, and what each one's merged input needs on the ranks
(no MLX here: the node, the API and the planner read it)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exo_tp.arch import supported_model_types  # pure tables: no MLX
from exo_tp.plan.stored import stored_bytes


@dataclass(frozen=True)
class VisionFamily:
    """What a family's merged input needs on the ranks."""

    mrope: bool = False  # 3-D positions (Qwen 3.5, Qwen3-VL)
    # the mlx-vlm family whose LanguageModel.get_rope_index gives those positions
    rope_index: str = "qwen3_5"
    scale_attr: str | None = None  # the text stack's embedding scale (Gemma 4)
    # the tower's features of some of its blocks, added at image rows after the first text
    # layers (Qwen3-VL's deepstack)
    deepstack: bool = False


VISION_FAMILIES: dict[str, VisionFamily] = {
    "qwen3_5": VisionFamily(mrope=True),
    "qwen3_5_moe": VisionFamily(mrope=True),
    "qwen3_vl": VisionFamily(mrope=True, rope_index="qwen3_vl", deepstack=True),
    "gemma4": VisionFamily(scale_attr="embed_scale"),
    # mlx-lm's gemma3_text scales the reduced embedding, image rows included, as mlx-vlm's does:
    # the tower's rows (its features over sqrt(hidden)) go in as they are, no wrapper scale.
    "gemma3": VisionFamily(),
    # Pixtral's tower: its features at the [IMG] tokens only; the row breaks and the end token
    # are text, embedded by the ranks (mlx-vlm's merge); 1-D positions, no scale.
    "mistral3": VisionFamily(),
    # MoonViT's tower (Kimi K2.5): features at the media placeholders; DeepSeek V3's text model.
    "kimi_k25": VisionFamily(),
}


def vision_config(model_dir: Path) -> dict[str, Any] | None:
    """The checkpoint's config.json when it holds a vision tower the cluster runs (a family of
    VISION_FAMILIES with a tensor-parallel table for its top-level model type), else None:
    another checkpoint serves its text, and the API answers an image for it with a 400
    (unsupported_vision_family says why)."""
    config = _config(model_dir)
    if config is None or _why_not(str(config.get("model_type"))) is not None:
        return None
    return config


@dataclass(frozen=True)
class NoImages:
    """A checkpoint with a vision tower the cluster does not run: it serves its text, and an
    image for it is a 400 saying ``reason``."""

    reason: str


def unsupported_vision_family(model_dir: Path) -> str | None:
    """Why the cluster does not run the vision tower of a checkpoint that has one (a sentence
    naming its model type), None where it does or there is no tower."""
    config = _config(model_dir)
    return None if config is None else _why_not(str(config.get("model_type")))


def _why_not(kind: str) -> str | None:
    if kind not in VISION_FAMILIES:
        served = ", ".join(sorted(set(VISION_FAMILIES) & set(supported_model_types())))
        return f"images are not served for the vision family {kind!r} yet (only {served})"
    if kind not in supported_model_types():
        # the ranks split the text model by the top-level type's table (language_model paths)
        return f"images for {kind!r} need a tensor-parallel table for that model type"
    return None


def _config(model_dir: Path) -> dict[str, Any] | None:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        return None
    config = json.loads(path.read_text())
    return config if config.get("vision_config") else None


def tower_bytes(model_dir: Path) -> int:
    """Bytes of a checkpoint's tensors outside its language model (the vision tower, its
    projector; mlx-vlm's layout), from the safetensors headers alone."""
    return stored_bytes(model_dir, lambda name: not name.startswith("language_model."))


def image_patches(vision: dict[str, Any]) -> int:
    """Patches the tower runs for one image at the checkpoint's own image size (its vision
    config's image_size over patch_size, squared; 1,024 where it names neither)."""
    size, patch = vision.get("image_size"), vision.get("patch_size")
    if isinstance(size, list | tuple):
        size = max(size)
    if not isinstance(size, int) or not isinstance(patch, int) or patch <= 0:
        return 1024
    return (size // patch) ** 2
