"""An image prompt made where the request arrives: mlx-vlm's processor turns the rendered text
and the images into token ids and the tower's inputs, exactly as ``mlx_vlm.generate`` prepares
them; for M-RoPE families mlx-vlm's own ``get_rope_index`` gives the positions, shifted by its
``rope_deltas`` so that the tokens after the last image sit at their index (docs/vision.md).
"""

from __future__ import annotations

import hashlib
import importlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from exo_tp.vision.families import VISION_FAMILIES
from exo_tp.wire.vision import Tensor, VisionPrompt

# The processor's per-token outputs: the ranks have the ids; the tower reads none of them (and
# the registry's key must not change with the text after the last image).
_NOT_TOWER = ("input_ids", "attention_mask", "mask", "token_type_ids", "mm_token_type_ids")


class ImagePrompter:
    """A vision checkpoint's processor, loaded once (offline, from the folder)."""

    def __init__(self, model_dir: Path):
        from mlx_vlm.utils import (
            get_model_and_args,
            load_config,
            load_image_processor,
            load_processor,
        )

        self.config: dict[str, Any] = load_config(Path(model_dir))
        get_model_and_args(self.config)  # registers the family's torch-free processor
        processor = load_processor(
            Path(model_dir), True, eos_token_ids=self.config.get("eos_token_id")
        )
        image_processor = load_image_processor(Path(model_dir))
        if image_processor is not None:
            processor.image_processor = image_processor
        self.processor = processor
        self.model_type: str = self.config["model_type"]
        self.family = VISION_FAMILIES.get(self.model_type)
        # Kimi K2.5 names it media_placeholder_token_id (mlx-vlm's image_token_index then)
        names = ("image_token_id", "image_token_index", "media_placeholder_token_id")
        self.image_token: int = int(
            next((self.config[n] for n in names if self.config.get(n) is not None), -1)
        )

    def prompt(self, text: str, images: list[Any]) -> tuple[list[int], VisionPrompt]:
        """The prompt's token ids and what the ranks need of its images (PIL images)."""
        from mlx_vlm.utils import prepare_inputs, should_add_special_tokens

        inputs = prepare_inputs(
            self.processor,
            images=images,
            prompts=text,
            image_token_index=self.image_token,
            add_special_tokens=should_add_special_tokens(self.model_type, self.processor),
        )
        tokens = [int(t) for t in np.array(inputs["input_ids"]).reshape(-1)]
        where = [i for i, t in enumerate(tokens) if t == self.image_token]
        if not where:
            raise ValueError("the processor placed no image token in the prompt")
        span = where[-1] + 1
        tower = {
            name: Tensor.of(np.array(value))
            for name, value in inputs.items()
            if name not in _NOT_TOWER and value is not None and hasattr(value, "shape")
        }
        positions = None
        if self.family is not None and self.family.mrope:
            positions = Tensor.of(self._positions(inputs, span))
        digest = hashlib.sha256(np.asarray(tokens[:span], dtype=np.int64).tobytes())
        for name in sorted(tower):
            digest.update(name.encode() + tower[name].data.encode())
        vision = VisionPrompt(
            key=digest.hexdigest(),
            span=span,
            image_token=self.image_token,
            tower_inputs=tower,
            positions=positions,
            images=len(images),
        )
        return tokens, vision

    def _positions(self, inputs: dict[str, Any], span: int) -> np.ndarray:
        assert self.family is not None
        language = importlib.import_module(f"mlx_vlm.models.{self.family.rope_index}.language")
        config = SimpleNamespace(
            vision_config=SimpleNamespace(
                spatial_merge_size=self.config["vision_config"]["spatial_merge_size"]
            ),
            image_token_id=self.image_token,
            video_token_id=self.config.get("video_token_id"),
            vision_start_token_id=self.config.get("vision_start_token_id"),
        )
        positions, deltas = language.LanguageModel.get_rope_index(
            SimpleNamespace(config=config),  # type: ignore[arg-type]
            inputs["input_ids"],
            inputs.get("image_grid_thw"),
            None,
            inputs.get("attention_mask"),
        )
        shift = int(np.array(deltas).reshape(-1)[0])
        return (np.array(positions)[:, 0, :span] - shift).astype(np.int32)
