"""The one way exo-tp loads a model's tokenizer: exactly as `mlx_lm.load` does.

`mlx_lm.load` passes the model config's `eos_token_id` (after `generation_config.json` overrides
it) to `load_tokenizer`. Instruct models often list their end-of-turn token only there (Gemma 3:
`[1, 106]`, Llama 3: `<|eot_id|>`), so a bare `load_tokenizer(folder)` would generate past the end
of the turn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_config, load_tokenizer


def load_model_tokenizer(
    model_dir: Path, tokenizer_config: dict[str, Any] | None = None
) -> TokenizerWrapper:
    """The tokenizer `mlx_lm.load(model_dir)` would return, with the config's stop tokens."""
    config = load_config(Path(model_dir))
    return load_tokenizer(
        Path(model_dir), tokenizer_config, eos_token_ids=config.get("eos_token_id", None)
    )
