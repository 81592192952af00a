"""Server-side generation defaults: what a request that omits a field gets (the flags of
`exo-tp run`, with mlx_lm.server's names and defaults)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from exo_tp.api.core.image_fetch import ImageUrlPolicy
from exo_tp.frozen import Frozen


class GenerationDefaults(Frozen):
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)  # --temp
    top_p: float = Field(default=1.0, ge=0.0, le=1.0)  # --top-p
    top_k: int = Field(default=0, ge=0)  # --top-k (0: off)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)  # --min-p (0: off)
    max_tokens: int = Field(default=512, ge=1)  # --max-tokens
    # --chat-template-args: extra arguments of the chat template, e.g. {"enable_thinking": false}
    chat_template_args: dict[str, Any] = Field(default_factory=dict)
    # --image-urls and its limits: whether and how image URLs in requests are fetched (off)
    image_urls: ImageUrlPolicy = Field(default_factory=ImageUrlPolicy)
