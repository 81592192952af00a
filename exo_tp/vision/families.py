"""The vision families the cluster runs, and what each one's merged input needs on the ranks
(no MLX here: the node, the API and the planner read it)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class VisionFamily:
    """What a family's merged input needs on the ranks."""

    mrope: bool = False  # 3-D positions (Qwen 3.5, Qwen3-VL)
    scale_attr: str | None = None  # the text stack's embedding scale (Gemma 4)


VISION_FAMILIES: dict[str, VisionFamily] = {
    "qwen3_5": VisionFamily(mrope=True),
    "qwen3_5_moe": VisionFamily(mrope=True),
    "gemma4": VisionFamily(scale_attr="embed_scale"),
}


def vision_config(model_dir: Path) -> dict[str, Any] | None:
    """The checkpoint's config.json when it holds a vision tower the cluster runs (a family of
    VISION_FAMILIES), else None: another family's checkpoint serves its text, and the API
    answers an image for it with a 400 (unsupported_vision_family names it)."""
    config = _config(model_dir)
    if config is None or config.get("model_type") not in VISION_FAMILIES:
        return None
    return config


def unsupported_vision_family(model_dir: Path) -> str | None:
    """The model type of a checkpoint with a vision tower the cluster does not run yet."""
    config = _config(model_dir)
    kind = config.get("model_type") if config else None
    return str(kind) if config and kind not in VISION_FAMILIES else None


def _config(model_dir: Path) -> dict[str, Any] | None:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        return None
    config = json.loads(path.read_text())
    return config if config.get("vision_config") else None


def tower_bytes(model_dir: Path) -> int:
    """Bytes of a checkpoint's tensors outside its language model (the vision tower, its
    projector; mlx-vlm's layout), from the safetensors headers alone."""
    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with path.open("rb") as file:
            size = int.from_bytes(file.read(8), "little")
            header = json.loads(file.read(size))
        for name, info in header.items():
            if name != "__metadata__" and not name.startswith("language_model."):
                start, stop = info["data_offsets"]
                total += stop - start
    return total
