"""What a fine-tuning rank fetches to take its cut: only what it lacks, and what its loader reads.

Row-parallel linears (o_proj, down_proj) are cut by input columns for training, as a serving
plan and the weights manifest cut them, so a node that served the model keeps the columns it
holds and fetches only the other columns of its training share. The first test counts those
bytes by hand from the shapes; the second records what the fine-tuning loader reads on every
rank of a real tiny checkpoint and checks the transfer brings all of it (and, for the column
cuts, nothing else).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from arch_configs import tiny_config
from tiny_models import write_tiny_model
from weights_synthetic import llama_spec, synthetic_manifest

from exo_tp.finetune.boxes import finetune_boxes
from exo_tp.finetune.gather import GatherChain
from exo_tp.finetune.model import build_model
from exo_tp.plan import plan_tensor_parallel
from exo_tp.plan.finetune import plan_finetune
from exo_tp.plan.pipeline import single_stage
from exo_tp.shard.safetensors_slices import SafetensorsIndex
from exo_tp.weights.boxes import Boxes, rank_boxes
from exo_tp.weights.build import build_manifest
from exo_tp.weights.transfer import Holding, plan_shares
from exo_tp.wire.finetune_job import LoraSettings

COLUMN_CUT = ("self_attn.o_proj", "mlp.down_proj")


def _minimum(quant: tuple[int, int] | None) -> dict[str, int]:
    """Bytes node B lacks of its training share of one layer's o_proj and down_proj, by hand.

    The model: 8 heads of 16 (hidden 128), FFN 256, float32 or 4-bit in groups of 32 (fp16
    scales and biases). B served as rank 1 of 2 even ranks: heads 4-7, o_proj input columns
    [64, 128) and down_proj's FFN columns [128, 256), all 128 rows. It trains as rank 1 of
    memory shares 1:3, in units of the serving cut's finest grain (o_proj: 16 columns in float,
    32 in 4-bit, where a head cut must land on a group; down_proj: 32 columns), so 3/4 of 8 (or
    4) units: o_proj columns [32, 128) and down_proj [64, 256). It lacks o_proj [32, 64) and
    down_proj [64, 128) of every row."""
    rows = 128
    lacking = {"self_attn.o_proj": 64 - 32, "mlp.down_proj": 128 - 64}
    out = {}
    for module, columns in lacking.items():
        if quant is None:
            out[f"{module}.weight"] = columns * rows * 4
        else:
            group, bits = quant
            out[f"{module}.weight"] = columns * bits // 32 * rows * 4  # packed uint32
            out[f"{module}.scales"] = columns // group * rows * 2  # one fp16 per group
            out[f"{module}.biases"] = columns // group * rows * 2
    return out


@pytest.mark.parametrize("quant", [None, (32, 4)], ids=["float", "q4"])
def test_a_serving_node_fetches_only_the_training_columns_it_lacks(
    quant: tuple[int, int] | None,
) -> None:
    spec = llama_spec(8, 8, 16, 128, 256, 512, 2, True, quant)
    manifest = synthetic_manifest(spec, quant)
    serving = single_stage(plan_tensor_parallel(spec, [1, 1]))
    held = rank_boxes(manifest, serving, 1)
    holdings = [Holding(node="A", files=True), Holding(node="B", store=held)]
    plan = plan_finetune([1, 3], [1, 1], batch_size=2)
    shares = [finetune_boxes(manifest, plan, r) for r in range(2)]
    transfer = plan_shares(manifest, shares, ["A", "B"], holdings)

    assert transfer.node("A").fetches == ()  # it has the files
    fetched: dict[str, int] = {}
    for f in transfer.node("B").fetches:
        size = manifest.tensor(f.tensor).bytes_of(((f.start, f.stop),))
        fetched[f.tensor] = fetched.get(f.tensor, 0) + size
    minimum = _minimum(quant)
    for layer in range(spec.num_layers):
        for name, size in minimum.items():
            assert fetched[f"model.layers.{layer}.{name}"] == size, name
    # Before the column cut, every row of every column B lacked came: twice the bytes here.
    whole = sum(
        manifest.tensor(n).bytes_of(rs)
        for n, rs in Boxes(
            ranges={
                n: ((0, manifest.tensor(n).length),)
                for n in manifest.by_name
                if n.rpartition(".")[0].endswith(COLUMN_CUT)
            }
        )
        .minus(held)
        .ranges.items()
    )
    assert whole == 2 * sum(minimum.values()) * spec.num_layers
    # Everything else B fetches is rows of its share it did not hold.
    for name, size in fetched.items():
        if not name.rpartition(".")[0].endswith(COLUMN_CUT):
            entry = manifest.tensor(name)
            assert size == shares[1].minus(held).meet(
                Boxes(ranges={name: ((0, entry.length),)})
            ).nbytes(manifest)


@pytest.mark.parametrize("quantize", [None, {"group_size": 64, "bits": 4}], ids=["float", "q4"])
def test_the_transfer_brings_every_byte_the_finetune_loader_reads(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    default_models: dict[str, Path],
    quantize: dict[str, int] | None,
) -> None:
    """A tiny llama with biases on o_proj and down_proj, 3 ranks with memory shares 5:3:2."""
    folder = write_tiny_model(
        tmp_path / "llama",
        tiny_config("llama", quantized=quantize is not None),
        default_models["smollm2-135m"],
        quantize=quantize,
    )
    manifest = build_manifest(folder)
    plan = plan_finetune([5, 3, 2], [1, 1, 1], batch_size=3)
    read = SafetensorsIndex.read
    reads: list[tuple[str, list[tuple[int, int]]]] = []

    def recording(
        self: SafetensorsIndex,
        name: str,
        axis: int | None = None,
        ranges: tuple[tuple[int, int], ...] = (),
    ) -> mx.array:
        entry = manifest.tensor(name)
        if axis is None:
            reads.append((name, [(0, entry.length)]))
        else:
            assert axis % len(entry.shape) == entry.axis, name  # along the manifest's axis
            reads.append((name, list(ranges)))
        return read(self, name, axis, ranges)

    columns = 0
    for rank in range(plan.size):
        reads.clear()
        monkeypatch.setattr(SafetensorsIndex, "read", recording)
        chain = GatherChain(mx.distributed.init(), prefetch=False)
        build_model(folder, LoraSettings(num_layers=-1), 0, plan, rank, chain)
        monkeypatch.undo()
        want, got = Boxes.of(reads), finetune_boxes(manifest, plan, rank)
        assert not want.minus(got).ranges, f"rank {rank} reads what it does not fetch"
        for name, ranges in got.ranges.items():
            module, _, part = name.rpartition(".")
            if module.endswith(COLUMN_CUT):
                if part == "bias":  # the full output width, added by every rank
                    assert ranges == ((0, manifest.tensor(name).length),)
                else:  # exactly the columns it reads
                    assert ranges == want.ranges[name], name
                    columns += 1
    assert columns >= 2 * 2 * 3  # o_proj and down_proj of 2 layers on 3 ranks (or all parts)
