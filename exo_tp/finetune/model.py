"""Build one rank's LoRA model: mlx-lm's model and LoRA layers over a row-sharded frozen base.

mlx-lm builds the model lazily and converts its linears to LoRA layers exactly as
`mlx_lm.lora` does (same seed, same order, so every rank and a single-device run start from the
same LoRA weights); then every base linear and embedding is replaced by a sharded one holding
only this rank's rows (or input columns: `exo_tp.finetune.columns`), read straight from the
safetensors files, and evaluated one at a time so the rank's peak stays near its share.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tuner.utils import linear_to_lora_layers

from exo_tp.arch import ArchTable, table_for
from exo_tp.errors import ExoTpError
from exo_tp.finetune.columns import ColumnCut, column_cut
from exo_tp.finetune.gather import GatherChain
from exo_tp.finetune.sharded import (
    PARTS,
    Layout,
    ShardedBase,
    ShardedEmbedding,
    ShardedLinear,
    quantization_of,
)
from exo_tp.plan.finetune import FinetunePlan
from exo_tp.plan.spec import ModelSpec, load_spec
from exo_tp.shard.slicing import WeightSlicer, load_lazily
from exo_tp.shard.tree import flat_items, set_path
from exo_tp.weights.layout import locate, split_of
from exo_tp.wire.finetune_job import LoraSettings

BASES = (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding)
EMBEDDINGS = (nn.Embedding, nn.QuantizedEmbedding)
LORA_PARTS = ("lora_a", "lora_b")


@dataclass(frozen=True)
class Footprint:
    base_bytes: int  # the whole base as stored
    held_bytes: int  # what this rank holds of it
    lora_bytes: int


def lora_parameters(lora: LoraSettings) -> dict[str, float]:
    """`lora_parameters` as mlx-lm's linear_to_lora_layers and adapter_config.json take them."""
    return {"rank": lora.rank, "dropout": lora.dropout, "scale": lora.scale}


def build_model(
    model_dir: Path,
    lora: LoraSettings,
    seed: int,
    plan: FinetunePlan,
    rank: int,
    chain: GatherChain,
) -> tuple[nn.Module, Footprint]:
    model, _, slicer = load_lazily(Path(model_dir))
    stored = {id(m): path for path, m in model.named_modules() if isinstance(m, BASES)}
    base_bytes = sum(v.nbytes for _, v in flat_items(model.parameters()))
    layers = len(model.layers)
    if lora.num_layers > layers:
        raise ExoTpError(f"--num-layers {lora.num_layers} is more than the model's {layers} layers")
    # What mlx_lm.lora's train_model does, in the same order (the seed fixes the LoRA init).
    mx.random.seed(seed)
    model.freeze()
    linear_to_lora_layers(model, lora.num_layers, lora_parameters(lora))
    serving = _serving(Path(model_dir))
    for path, module in [(p, m) for p, m in model.named_modules() if isinstance(m, BASES)]:
        name = stored[id(module)]
        cut = _column_cut(module, name, slicer, serving)
        set_path(model, path, _shard(module, name, slicer, plan, rank, chain, cut))
    _refuse_unsharded(model)
    mx.eval(model.parameters())
    held = sum(v.nbytes for p, v in flat_items(model.parameters()) if ".lora_" not in p)
    lora_bytes = sum(v.nbytes for _, v in flat_items(model.trainable_parameters()))
    return model, Footprint(base_bytes=base_bytes, held_bytes=held, lora_bytes=lora_bytes)


def _serving(model_dir: Path) -> tuple[ModelSpec, ArchTable] | None:
    """The model's spec and tensor-parallel table, whose serving cut column cuts follow."""
    try:
        spec = load_spec(model_dir)
        return spec, table_for(spec.model_type)
    except ExoTpError:
        return None  # no serving cut to follow (as no manifest can be built): all by rows


def _column_cut(
    module: nn.Module,
    stored_name: str,
    slicer: WeightSlicer,
    serving: tuple[ModelSpec, ArchTable] | None,
) -> ColumnCut | None:
    """How a base linear is cut by columns (as `exo_tp.finetune.boxes` reads the manifest:
    only parts read straight from the files, cut where a serving plan may cut them)."""
    if serving is None or isinstance(module, EMBEDDINGS):
        return None
    spec, table = serving
    parts = {}
    for key in PARTS:
        value = module.get(key)
        if not isinstance(value, mx.array) or key == "bias":
            continue
        name = f"{stored_name}.{key}"
        shape = tuple(value.shape)
        split = split_of(locate(name, table), shape, spec)
        if split is None or not (name in slicer.direct and slicer.files.matches(name, value)):
            return None
        parts[key] = (len(shape), split.axis, tuple(split.storage(p) for p in split.points))
    return column_cut(parts)


def _shard(
    module: nn.Module,
    stored_name: str,
    slicer: WeightSlicer,
    plan: FinetunePlan,
    rank: int,
    chain: GatherChain,
    cut: ColumnCut | None,
) -> ShardedBase:
    kind = ShardedEmbedding if isinstance(module, EMBEDDINGS) else ShardedLinear
    quantization = quantization_of(module)
    present = [key for key in PARTS if isinstance(module.get(key), mx.array)]
    if cut is not None:
        return _shard_columns(module, stored_name, slicer, plan, rank, chain, cut, present)
    split = plan.rows(module["weight"].shape[0])
    span = split.spans[rank]
    parts = {
        key: slicer.take(f"{stored_name}.{key}", module[key], 0, [(span.start, span.stop)])
        for key in present
    }
    mx.eval(parts)  # one tensor's rows at a time: the peak stays at the share
    shapes = {key: tuple(module[key].shape) for key in parts}
    sizes = {key: split.sizes for key in parts}
    return kind(parts, Layout(sizes, shapes), chain, quantization)


def _shard_columns(
    module: nn.Module,
    stored_name: str,
    slicer: WeightSlicer,
    plan: FinetunePlan,
    rank: int,
    chain: GatherChain,
    cut: ColumnCut,
    present: list[str],
) -> ShardedBase:
    """This rank's input columns of a linear's parts, held transposed, and its bias whole."""
    units = plan.units(cut.units)
    parts: dict[str, mx.array] = {}
    sizes: dict[str, tuple[int, ...]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for key in cut.points:
        value = module[key]
        start, stop = cut.span(key, units.spans[rank])
        if stop > start:
            mine = slicer.take(f"{stored_name}.{key}", value, 1, [(start, stop)])
            parts[key] = mx.contiguous(mine.T)
        else:
            parts[key] = mx.zeros((0, value.shape[0]), dtype=value.dtype)
        sizes[key] = tuple(b - a for a, b in (cut.span(key, s) for s in units.spans))
        shapes[key] = (value.shape[1], value.shape[0])
        mx.eval(parts[key])
    replicated = {key: module[key] for key in present if key not in cut.points}
    mx.eval(replicated)
    return ShardedLinear(
        parts, Layout(sizes, shapes, columns=True), chain, quantization_of(module), replicated
    )


def _refuse_unsharded(model: nn.Module) -> None:
    """Only small replicated parameters (norms) may stay whole on every rank.

    The refusal names the family: mixture-of-experts families (stacked expert weights) and
    MLA's per-head stacks are refused here, whichever table serves them."""
    family = getattr(model, "model_type", type(model).__module__.rpartition(".")[2])
    for path, module in model.named_modules():
        if isinstance(module, ShardedBase):
            continue
        for key, value in module.items():
            if isinstance(value, mx.array) and value.ndim >= 2 and key not in LORA_PARTS:
                raise ExoTpError(
                    f"{family}: exo-tp finetune shards dense linears and embeddings only; "
                    f"{path}.{key} is a {tuple(value.shape)} {type(module).__name__} weight"
                )
