"""The tiny vision-language checkpoints (tests/vlm_models.py) on one device, through mlx-vlm alone.

The reference a cluster serving images (issue #58) is compared with: ``mlx_vlm.load``, a prompt
rendered by mlx-vlm's own ``apply_chat_template`` and greedy ``mlx_vlm.stream_generate`` with a
small generated image give at least 16 tokens, the same on every run, and another image gives
other tokens (the vision tower and the merged embeddings are really in play).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_vlm", reason="mlx-vlm is not installed (.ci/install installs it)")
from vlm_models import ALL_FAMILIES, gradient, greedy, write_tiny_vlm  # noqa: E402

TOKENS = 16
# Gemma 4's processor builds its audio feature extractor whatever the checkpoint holds.
pytestmark = pytest.mark.filterwarnings("ignore:At least one mel filter:UserWarning")


@pytest.fixture(scope="module")
def checkpoints(
    default_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Path]]:
    """Every family, written once (well under a second each here)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_OFFLINE", "1")  # everything from the folders, never the hub
        root = tmp_path_factory.mktemp("vlm")
        smollm2 = default_models["smollm2-135m"]
        yield {f: write_tiny_vlm(root / f, f, smollm2) for f in ALL_FAMILIES}


@pytest.fixture(scope="module")
def loaded(checkpoints: dict[str, Path]) -> dict[str, tuple[Any, Any]]:
    from mlx_vlm import load

    return {family: load(str(folder)) for family, folder in checkpoints.items()}


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_checkpoint_layout(family: str, checkpoints: dict[str, Path]) -> None:
    import json

    folder = checkpoints[family]
    config = json.loads((folder / "config.json").read_text())
    assert {"vision_config", "text_config"} <= set(config)
    # mlx-lm's text model under the family's own name, or the one it nests (Mistral 3, Kimi K2.5)
    text = {"mistral3": "ministral3", "kimi_k25": "kimi_k2"}.get(family, f"{family}_text")
    assert config["text_config"]["model_type"] == text
    assert sum(f.stat().st_size for f in folder.iterdir()) < 16e6


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_image_prompt_greedy_reference(family: str, loaded: dict[str, tuple[Any, Any]]) -> None:
    model, processor = loaded[family]
    first = greedy(model, processor, gradient(1))
    assert len(first) == TOKENS
    assert greedy(model, processor, gradient(1)) == first  # deterministic
    assert greedy(model, processor, gradient(7)) != first  # the image reaches the tokens
