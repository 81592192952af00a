"""A checkpoint's MTP heads in the plan: their bytes, from the safetensors headers alone.

Every rank of the last stage holds the heads whole beside its shard where they draft
(exo_tp.runtime.mtp: each runs them on the full hidden state it already has), so the planner
counts them there, whether or not a request will use them: a plan that fits only without
them would fail the moment `--mtp` is on. Their KV cache is one layer's for the one stream
that speculates, small beside the model's, and not counted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from exo_tp.plan.stored import stored_bytes

# Where the two shipped layouts keep them: Qwen's top-level block, and DeepSeek's and GLM's
# decoder layer after the last (``model.layers.<num_hidden_layers>``).
QWEN_PREFIX = "mtp."


DEPTH_FIELDS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")


def declared_mtp(config: dict[str, Any]) -> int:
    """How many MTP layers the config declares (0: none): Qwen's count, then DeepSeek's and
    GLM's, in the config or its text config."""
    for part in (config.get("text_config") or {}, config):
        for field in DEPTH_FIELDS:
            count = part.get(field)
            if isinstance(count, int) and count > 0:
                return count
    return 0


def is_heads_tensor(name: str, layers: int) -> bool:
    """Whether a checkpoint tensor belongs to the MTP heads (a model of ``layers`` layers)."""
    return name.startswith((QWEN_PREFIX, f"model.layers.{layers}."))


def heads_bytes(model_dir: Path, config: dict[str, Any]) -> int:
    """Bytes of the checkpoint's MTP tensors as stored (0: none)."""
    layers = (config.get("text_config") or config).get("num_hidden_layers")
    if not isinstance(layers, int):
        return 0
    return stored_bytes(model_dir, lambda name: is_heads_tensor(name, layers))
