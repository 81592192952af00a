"""The boxes the transfer planner moves are exactly what the loader reads.

``rank_boxes`` (pure, from the manifest) is compared with a real ``load_shard`` run whose reads
are recorded: every slice read on disk (``SafetensorsIndex.read``, patched here only) and every
tensor the finished shard holds as mlx-lm loaded it (whole; found by identity with the arrays
``mx.load`` returned). A parameter of the shard explained by neither fails the test, except in
checkpoints laid out as shipped (Hugging Face names), where mlx-lm's sanitize derives some
parameters from file tensors (stacked experts): the boxes must then hold what was read plus only
such non-sliceable tensors, whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from arch_configs import tiny_config
from mlx.utils import tree_flatten
from tiny_models import Form, write_tiny_model

from exo_tp.plan import load_spec, plan_tensor_parallel
from exo_tp.plan.pipeline import PipelinePlan, plan_pipeline, single_stage
from exo_tp.shard.apply import load_shard
from exo_tp.shard.safetensors_slices import SafetensorsIndex
from exo_tp.weights.boxes import Boxes, rank_boxes
from exo_tp.weights.build import build_manifest, manifest_for
from exo_tp.weights.manifest import ModelManifest


def recorded_reads(
    monkeypatch: pytest.MonkeyPatch,
    folder: Path,
    manifest: ModelManifest,
    plan: PipelinePlan,
    rank: int,
    derived: bool = False,
) -> Boxes:
    reads: list[tuple[str, int | None, list[tuple[int, int]]]] = []
    sliced: set[int] = set()
    loaded: dict[int, tuple[str, mx.array]] = {}
    read, load = SafetensorsIndex.read, mx.load

    def recording_read(
        self: SafetensorsIndex, name: str, axis: int | None = None, ranges: Any = ()
    ) -> mx.array:
        reads.append((name, axis, list(ranges)))
        out = read(self, name, axis, ranges)
        sliced.add(id(out))
        return out

    def recording_load(path: str, *args: Any, **kwargs: Any) -> Any:
        out = load(path, *args, **kwargs)
        if isinstance(out, dict):
            loaded.update({id(a): (n, a) for n, a in out.items()})  # keeps them alive
        return out

    monkeypatch.setattr(SafetensorsIndex, "read", recording_read)
    monkeypatch.setattr(mx, "load", recording_load)
    index, local = plan.locate(rank)
    stage = plan.stages[index]
    model = load_shard(
        folder,
        stage.tp,
        local,
        mx.distributed.init(),
        None,
        stage.layers,
        index == 0,
        index == len(plan.stages) - 1,
    )
    monkeypatch.undo()

    pairs = []
    for name, axis, ranges in reads:
        entry = manifest.tensor(name)
        if axis is None:
            pairs.append((name, [(0, entry.length)]))
            continue
        assert axis % len(entry.shape) == entry.axis or not ranges, name
        pairs.append((name, ranges))
    for path, array in tree_flatten(model.parameters()):
        if id(array) in loaded:
            pairs.append(
                (loaded[id(array)][0], [(0, manifest.tensor(loaded[id(array)][0]).length)])
            )
        else:
            assert derived or id(array) in sliced, f"{path}: neither read on disk nor loaded whole"
    return Boxes.of(pairs)


def check_plan(
    monkeypatch: pytest.MonkeyPatch,
    folder: Path,
    manifest: ModelManifest,
    plan: PipelinePlan,
    derived: bool = False,
) -> None:
    for rank in range(plan.size):
        want = recorded_reads(monkeypatch, folder, manifest, plan, rank, derived)
        got = rank_boxes(manifest, plan, rank)
        if derived:
            assert not want.minus(got).ranges, f"rank {rank}: read but not planned"
            for name, ranges in got.minus(want).ranges.items():
                entry = manifest.tensor(name)
                assert not entry.sliceable and list(ranges) == [(0, entry.length)], name
            continue
        assert got == want, (
            f"rank {rank}: planned but not read {got.minus(want).ranges}; "
            f"read but not planned {want.minus(got).ranges}"
        )


@pytest.mark.parametrize("model", ["smollm2-135m", "smollm2-135m-q4"])
def test_smollm2_boxes_are_the_loader_reads(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path_factory: pytest.TempPathFactory,
    default_models: dict[str, Path],
    model: str,
) -> None:
    folder = default_models[model]
    manifest = manifest_for(folder, tmp_path_factory.getbasetemp() / "manifests")
    spec = load_spec(folder)
    check_plan(monkeypatch, folder, manifest, single_stage(plan_tensor_parallel(spec, [5, 3, 2])))
    # two stages: 2 ranks over the first layers, 1 over the rest (tied embedding on both ends)
    check_plan(monkeypatch, folder, manifest, plan_pipeline(spec, [[3, 2], [4]]))


# (architecture, quantization): a MoE with shared experts, quantized MoE, packed q|k|v and
# gate|up, MLA stacks, biased gpt-oss with MX-FP4 experts and sinks, a plan with an empty rank;
# Gemma 3 as shipped has no lm_head (tied: the embedding is vocab-parallel on both ends); Kimi
# K2.5's layers nested under language_model and its compressed-tensors int4 experts (derived by
# sanitize: whole), DeepSeek V3.2's replicated indexer, Mistral 4's experts shipped fused,
# Step 3.5's sliding layers with more query heads than its full ones (spans scaled); Kimi K3's
# linear-attention heads (conv channels, per-head parameters) beside its MLA heads.
TINY = [
    ("gemma3_text", None),
    ("qwen2_moe", None),
    ("qwen3_moe", {"group_size": 64, "bits": 4}),
    ("phi3", None),
    ("deepseek_v3", {"group_size": 32, "bits": 8}),
    ("gpt_oss", {"group_size": 32, "bits": 4, "mode": "mxfp4"}),
    ("llama", {"group_size": 64, "bits": 4}),
    ("kimi_k25", {"compressed_tensors": True}),
    ("deepseek_v32", {"group_size": 64, "bits": 4}),
    ("mistral4", None),
    ("step3p5", {"group_size": 64, "bits": 4}),
    # two head widths, KV-shared layers' double-wide MLP, vocab-split per-layer embeddings
    ("gemma4_text", {"group_size": 64, "bits": 4}),
    # full-width q/k norms sliced by heads
    ("minimax", None),
    # the grouped output split per head (o_a's touched groups, o_b's columns of those groups)
    ("deepseek_v41", {"group_size": 64, "bits": 4}),
    # linear-attention and MLA layers, whose o_proj share a name but not a split
    ("kimi_k3", {"group_size": 64, "bits": 4}),
    # Mamba-2 groups: in_proj's five parts and the conv's three of different widths per group
    ("nemotron_h", None),
    # short-conv channels in units of the quantization group; a copied ModelArgs per block
    ("lfm2", {"group_size": 64, "bits": 4}),
    # Gated DeltaNet: packed q|k|v and conv channels of different widths per key head
    ("qwen3_5", {"group_size": 64, "bits": 4}),
]


@pytest.mark.parametrize("form", ["mlx", "shipped"])
@pytest.mark.parametrize(("arch", "quantize"), TINY, ids=[a for a, _ in TINY])
def test_tiny_architectures_boxes_are_the_loader_reads(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    default_models: dict[str, Path],
    arch: str,
    quantize: dict[str, Any] | None,
    form: Form,
) -> None:
    """Checkpoints as mlx-lm holds them (every read explained exactly), and as shipped (HF
    names: quantized ones through mlx-lm's converter, so only float ones differ)."""
    folder = write_tiny_model(
        tmp_path / arch,
        tiny_config(arch, quantized=quantize is not None),
        default_models["smollm2-135m"],
        quantize=quantize,
        form=form,
    )
    manifest = build_manifest(folder)
    spec = load_spec(folder)
    # compressed-tensors checkpoints are in the shipped layout whatever the form
    derived = form == "shipped" or bool(quantize and quantize.get("compressed_tensors"))
    for weights in ([5, 3, 2], [3, 0, 2]):  # [3, 0, 2]: a rank with nothing (stand-ins only)
        plan = single_stage(plan_tensor_parallel(spec, weights))
        check_plan(monkeypatch, folder, manifest, plan, derived)
    if arch == "llama":
        check_plan(monkeypatch, folder, manifest, plan_pipeline(spec, [[1, 2], [1]]), derived)
