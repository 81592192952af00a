"""An image prompt as it crosses processes (no MLX here): what the API computed from the
request's images with mlx-vlm's processor, for the ranks (issue #58, docs/vision.md).

The prompt's token ids stay the processor's (an image is its run of image tokens). Beside them:
``span``, the tokens up to the end of the last image, which the ranks run from a registry
(exo_tp.vision.registry) rather than from the vocabulary; the tower's inputs (pixel values and
the family's grid or patch positions) for the one rank that runs the vision tower; and, for
M-RoPE families (Qwen 3.5, Qwen3-VL), the span's 3-D positions as mlx-vlm computes them,
shifted so that the tokens after the span sit at their plain index (docs/vision.md says why).
"""

from __future__ import annotations

import base64
from typing import Literal

import numpy as np
from pydantic import Field

from exo_tp.frozen import Frozen

ArrayDType = Literal["float32", "float16", "int32", "int64", "uint8", "bool"]


class Tensor(Frozen):
    """A numpy array's bytes (C order, little-endian), base64 in the JSON framing."""

    dtype: ArrayDType
    shape: tuple[int, ...]
    data: str

    @classmethod
    def of(cls, array: np.ndarray) -> Tensor:
        array = np.ascontiguousarray(array)
        name = str(array.dtype)
        if name not in ArrayDType.__args__:  # type: ignore[attr-defined]
            array, name = array.astype(np.float32), "float32"
        return cls(dtype=name, shape=array.shape, data=base64.b64encode(array.tobytes()).decode())  # type: ignore[arg-type]

    def numpy(self) -> np.ndarray:
        raw = base64.b64decode(self.data)
        return np.frombuffer(raw, dtype=self.dtype).reshape(self.shape)

    @property
    def nbytes(self) -> int:
        return len(self.data) * 3 // 4


class VisionPrompt(Frozen):
    """A prompt's images, as the ranks need them (module doc)."""

    # The span's identity: its token ids and its images' pixels. The same key again reuses the
    # registry's entry (its token ids, so the prompt cache hits, and the tower's features).
    key: str = Field(min_length=16, max_length=128)
    span: int = Field(ge=1)
    image_token: int = Field(ge=0)  # the processor's image token: the tower's rows
    tower_inputs: dict[str, Tensor]  # mlx-vlm's get_input_embeddings keyword arguments
    positions: Tensor | None = None  # (3, span) int32: M-RoPE positions, shifted
    images: int = Field(default=1, ge=1)
