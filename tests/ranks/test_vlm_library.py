"""Images through the library on local ranks (issue #58): `exo_tp.load(...).stream_generate(prompt,
image=[...])`, as mlx-vlm's `stream_generate` takes them, on 3 uneven ranks (5, 3, 1), as two
pipeline stages, and on 4-bit checkpoints converted by mlx-vlm itself: the greedy tokens equal
single-device mlx-vlm's for the same prompt (rendered by its own chat template) and image."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_vlm", reason="mlx-vlm is not installed (.ci/install installs it)")
from vlm_models import ALL_FAMILIES, PROMPT, TOKENS, gradient, greedy, write_tiny_vlm  # noqa: E402

import exo_tp  # noqa: E402
from exo_tp.errors import ExoTpError  # noqa: E402
from exo_tp.vision.families import unsupported_vision_family  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:At least one mel filter:UserWarning")


@pytest.fixture(scope="module")
def checkpoints(
    default_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Path]]:
    """Each family in float32, and quantized to 4 bits by mlx-vlm's own converter."""
    from mlx_vlm.convert import convert

    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_OFFLINE", "1")
        root = tmp_path_factory.mktemp("vlm-library")
        folders = {}
        for family in ALL_FAMILIES:
            folders[family] = write_tiny_vlm(root / family, family, default_models["smollm2-135m"])
            quantized = root / f"{family}-4bit"
            convert(
                str(folders[family]),
                mlx_path=str(quantized),
                quantize=True,
                q_bits=4,
                q_group_size=32,
            )
            folders[f"{family}-4bit"] = quantized
        yield folders


def _reference(folder: Path, shade: int) -> tuple[str, list[int]]:
    from mlx_vlm import load
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = load(str(folder))
    prompt = apply_chat_template(processor, model.config, PROMPT, num_images=1)
    return prompt, greedy(model, processor, gradient(shade))


def _ours(model: Any, prompt: str, shade: int) -> list[int]:
    responses = model.stream_generate(prompt, TOKENS, image=[gradient(shade)])
    return [r.token for r in responses if r.token is not None]


@pytest.mark.parametrize("name", [*ALL_FAMILIES, *(f"{f}-4bit" for f in ALL_FAMILIES)])
def test_three_uneven_ranks_answer_as_mlx_vlm(name: str, checkpoints: dict[str, Path]) -> None:
    why = unsupported_vision_family(checkpoints[name])
    if why is not None:  # Gemma 3 until exo-tp's tables name its top-level type
        pytest.skip(why)
    prompt, expected = _reference(checkpoints[name], 2)
    with exo_tp.load(str(checkpoints[name]), ranks=3, weights=[5, 3, 1]) as model:
        assert _ours(model, prompt, 2) == expected
        assert _ours(model, prompt, 2) == expected  # the same image again: its registered span


# Gemma 4 runs as one stage (its table's why); Qwen3-VL's deepstack needs both its layers on
# the first stage (exo_tp.vision.text_model refuses fewer)
@pytest.mark.parametrize("family", ["qwen3_5"])
def test_two_pipeline_stages_answer_as_mlx_vlm(family: str, checkpoints: dict[str, Path]) -> None:
    """The tower on the first stage; the last stage's attention rotates by the same M-RoPE
    positions, carried by the registry every rank fills alike."""
    prompt, expected = _reference(checkpoints[family], 4)
    with exo_tp.load(str(checkpoints[family]), ranks=3, weights=[2, 1, 1], stages=[2, 1]) as model:
        assert _ours(model, prompt, 4) == expected


def test_an_image_for_a_text_model_is_one_clear_error(tiny_smollm2: Path) -> None:
    with exo_tp.load(str(tiny_smollm2), ranks=2) as model:
        with pytest.raises(ExoTpError, match="takes no images"):
            model.generate("Hi", 4, image=[gradient(1)])
        assert model.generate("Hi", 4)  # the ranks serve on
