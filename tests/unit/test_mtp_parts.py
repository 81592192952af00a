"""The MTP parts that need no ranks: the checkpoint layout mlx-vlm reads, the sizes the
planner counts, the hidden-state record, rewinding a recurrent state, and the CLI flag."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, BatchKVCache
from mtp_models import _drafter, mtp_config, write_mtp_model

from exo_tp.plan.spec import load_spec
from exo_tp.plan.stored import stored_bytes
from exo_tp.runtime.cache_rewind import rewind, save
from exo_tp.runtime.mtp.checkpoint import heads_names, load_heads
from exo_tp.runtime.mtp.tap import MOST_ROWS, HiddenTap


@pytest.mark.parametrize("arch", ["qwen3_5", "glm_moe_dsa"])
def test_heads_written_as_shipped_load_back_through_mlx_vlm(
    tmp_path: Path, default_models: dict[str, Path], arch: str
) -> None:
    """The heads written in the checkpoint's names (Qwen's zero-centred norms, GLM's fused
    kv_b_proj and per-expert tensors) come back from mlx-vlm's splitter as the drafter's own
    parameters, every one of them."""
    folder = write_mtp_model(tmp_path / arch, arch, default_models["smollm2-135m"], seed=3)
    loaded = dict(tree_flatten(load_heads(folder, mx.float32).parameters()))
    written = dict(tree_flatten(_drafter(arch, mtp_config(arch)).parameters()))
    assert set(loaded) == set(written)
    assert all(loaded[name].shape == written[name].shape for name in written)
    names = heads_names(folder)  # as mlx-vlm's splitter picks them; the planner by prefix
    spec = load_spec(folder)
    assert spec.mtp_bytes == stored_bytes(folder, names.__contains__) > 0
    assert load_spec(default_models["smollm2-135m"]).mtp_bytes == 0
    assert heads_names(default_models["smollm2-135m"]) == set()


def test_the_heads_read_what_was_written(tmp_path: Path, default_models: dict[str, Path]) -> None:
    """A value written under the shipped name is the value the drafter holds (Qwen's norm
    with its 1 added back)."""
    folder = write_mtp_model(tmp_path / "q", "qwen3_5", default_models["smollm2-135m"])
    stored = mx.load(str(folder / "model.safetensors"))
    heads = dict(tree_flatten(load_heads(folder, mx.float32).parameters()))
    assert mx.allclose(heads["fc.weight"], stored["mtp.fc.weight"])
    assert mx.allclose(heads["norm.weight"], stored["mtp.norm.weight"] + 1)
    config = json.loads((folder / "config.json").read_text())
    assert config["text_config"]["mtp_num_hidden_layers"] == 1


def test_the_record_keeps_one_streams_rows_and_cuts_rejected_positions() -> None:
    tap = HiddenTap(lambda x: x * 2)  # type: ignore[arg-type]
    tap(mx.ones((1, 5, 4)))  # a prompt chunk
    tap(mx.ones((1, 1, 4)))  # a step
    assert tap.size() == 6
    tap(mx.ones((1, 4, 4)))  # a verify step of 4 positions, 2 kept
    tap.cut(6 + 2)
    states = tap.take()
    assert states is not None and states.shape == (8, 4) and tap.size() == 0
    tap(mx.ones((1, 3, 4)))
    tap(mx.ones((2, 1, 4)))  # two streams: no one stream's rows
    assert tap.take() is None
    for _ in range(MOST_ROWS + 10):  # a stream that never drafts keeps the latest only
        tap(mx.ones((1, 1, 4)))
    assert tap.size() == MOST_ROWS + 10
    held = tap.take()
    assert held is not None and held.shape[0] == MOST_ROWS


def test_a_recurrent_state_changed_in_place_is_restored_and_replayed() -> None:
    """A state the step changed in place (advance's -=, before it was ever computed) comes
    back as it was; the KV cache is trimmed to before the step; the kept inputs replay."""
    recurrent, kv = ArraysCache(1, left_padding=[0]), BatchKVCache([0])
    recurrent[0] = mx.zeros((1, 2)) + 1  # not yet computed
    recurrent.left_padding = mx.array([1]) - 1  # nor this, which advance changes in place
    kv.update_and_fetch(mx.zeros((1, 1, 3, 2)), mx.zeros((1, 1, 3, 2)))
    saved = save([recurrent, kv])
    seen = []

    def model(inputs: mx.array, cache: list) -> None:
        seen.append(inputs.tolist())
        cache[0][0] = cache[0][0] + inputs.shape[1]
        cache[0].advance(inputs.shape[1])
        cache[1].update_and_fetch(
            mx.zeros((1, 1, inputs.shape[1], 2)), mx.zeros((1, 1, inputs.shape[1], 2))
        )

    inputs = mx.array([7, 8, 9, 10])
    model(inputs[None], [recurrent, kv])  # the verify step
    rewind(model, [recurrent, kv], saved, inputs, 2)  # (nn.Module-like: called with cache=)
    assert seen[-1] == [[7, 8]]
    assert recurrent[0].tolist() == [[3.0, 3.0]]  # 1, then the 2 kept positions
    assert recurrent.left_padding.tolist() == [-2]
    assert int(kv.offset[0]) == 3 + 2


def test_mtp_flag_reaches_the_serving_options() -> None:
    from exo_tp.cli.speculative_args import _fields, add_speculative_args

    parser = argparse.ArgumentParser()
    add_speculative_args(parser)
    for argv, expected in (([], "auto"), (["--mtp"], "on"), (["--no-mtp"], "off")):
        fields = _fields(parser.parse_args(argv), None)
        assert fields["mtp"] == expected and fields["num_draft_tokens"] is None
    assert _fields(parser.parse_args(["--batch-drafts", "on"]), None)["batch_drafts"] == "on"


def test_a_bad_batch_drafts_value_is_one_cli_line() -> None:
    from helpers import run_cli

    done = run_cli(
        "launch", "--ranks", "1", "--prompt", "x", "--batch-drafts", "maybe", check=False
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "--batch-drafts: invalid choice: 'maybe'" in done.stderr


@pytest.mark.parametrize("arch", ["qwen3_5", "glm_moe_dsa"])
def test_the_heads_travel_to_the_last_stage_only(
    tmp_path: Path, default_models: dict[str, Path], arch: str
) -> None:
    """Weights between peers: every tensor mlx-vlm's splitter loads as the heads goes whole
    to each rank of the last stage, and none to the first stage's."""
    from exo_tp.plan.pipeline import plan_pipeline
    from exo_tp.weights.boxes import rank_boxes
    from exo_tp.weights.build import build_manifest

    folder = write_mtp_model(tmp_path / arch, arch, default_models["smollm2-135m"])
    names = heads_names(folder)
    manifest = build_manifest(folder)
    plan = plan_pipeline(load_spec(folder), [[1.0], [2.0, 1.0]])
    lengths = {entry.name: entry.length for entry in manifest.tensors}
    first, *last = (rank_boxes(manifest, plan, rank).ranges for rank in range(3))
    assert names and not names & set(first)
    for boxes in last:
        assert all(boxes[name] == ((0, lengths[name]),) for name in names)
