"""Apply an mlx-lm LoRA adapter to one rank's tensor-parallel shard, exactly and unfused.

An adapter folder is what `mlx_lm.lora` (and `exo-tp finetune`) writes: adapter_config.json and
adapters.safetensors with ``<layer path>.lora_a`` (in, r) and ``.lora_b`` (r, out). Each adapted
linear becomes mlx-lm's own `LoRALinear` around the rank's slice of the base (never fused, so a
quantized base stays bit-exact) with the matching slice of the adapter:

- column-parallel (output rows split): lora_b keeps this rank's output columns, in the order
  the base weight's rows are kept; ``(x @ A) @ B[:, rows]`` is exactly the full output's rows;
- row-parallel (input columns split): lora_a keeps this rank's input rows, so
  ``(x[cols] @ A[cols]) @ B`` is a partial sum that joins the branch's existing all-reduce;
- replicated modules keep the whole adapter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tuner.lora import LoRALinear

from exo_tp.arch import ArchTable
from exo_tp.arch.table import is_under
from exo_tp.errors import ExoTpError
from exo_tp.plan.slices import RankSelector
from exo_tp.shard.layers import PartialSum
from exo_tp.shard.safetensors_slices import Ranges
from exo_tp.shard.tree import get_path, has_path

SUFFIXES = (".lora_a", ".lora_b")


@dataclass(frozen=True)
class Adapter:
    rank: int
    scale: float
    weights: dict[str, mx.array]

    def targets(self, prefix: str) -> list[str]:
        """Paths (relative to ``prefix``) of the linears this adapter changes under it."""
        start = f"{prefix}."
        return sorted(
            {
                k[len(start) : -len(".lora_a")]
                for k in self.weights
                if k.startswith(start) and k.endswith(".lora_a")
            }
        )


def read_adapter(path: Path) -> Adapter:
    """An adapter folder as mlx_lm.lora writes it; anything else is one readable error."""
    path = Path(path)
    config_file, weights_file = path / "adapter_config.json", path / "adapters.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise ExoTpError(
            f"{path} is not an adapter folder (adapter_config.json and "
            f"adapters.safetensors, as mlx_lm.lora writes them)"
        )
    try:
        config: dict[str, Any] = json.loads(config_file.read_text())
        kind = config.get("fine_tune_type", "lora")
        params = config["lora_parameters"]
        rank, scale = int(params["rank"]), float(params["scale"])
    except (ValueError, KeyError, TypeError) as error:
        raise ExoTpError(f"{config_file}: not an mlx-lm LoRA adapter config ({error})") from None
    if kind != "lora":
        raise ExoTpError(f"{path}: fine_tune_type {kind!r} adapters are not supported (LoRA only)")
    weights = cast(dict[str, mx.array], mx.load(str(weights_file)))  # safetensors: a dict
    odd = [k for k in weights if not k.endswith(SUFFIXES)]
    if odd:
        raise ExoTpError(f"{weights_file}: {odd[0]} is not a LoRA weight (lora_a / lora_b)")
    for key in weights:
        pair = key[: -len(".lora_a")] + (".lora_b" if key.endswith(".lora_a") else ".lora_a")
        if pair not in weights:
            raise ExoTpError(f"{weights_file}: {key} has no matching {pair}")
    return Adapter(rank=rank, scale=scale, weights=weights)


def check_layers(adapter: Adapter, table: ArchTable, num_layers: int) -> None:
    """Every adapted linear lies in a transformer block of the model."""
    for key in adapter.weights:
        head, _, rest = key.partition(f"{table.layers}.")
        index = rest.split(".", 1)[0]
        if head or not index.isdigit() or int(index) >= num_layers:
            raise ExoTpError(
                f"adapter weight {key} is outside the model's {num_layers} "
                f"transformer blocks; only LoRA on their linears is supported"
            )


def apply_to_block(
    adapter: Adapter, block: nn.Module, prefix: str, table: ArchTable, mine: RankSelector
) -> None:
    """Wrap the block's adapted linears (this rank's slices) in mlx-lm LoRA layers."""
    for path in adapter.targets(prefix):
        a = adapter.weights[f"{prefix}.{path}.lora_a"]
        b = adapter.weights[f"{prefix}.{path}.lora_b"]
        parent, name = _parent(block, path)
        if parent is None:
            continue  # inside a sub-block this rank holds nothing of (a zero stand-in)
        # (a rule applying where its layer kind's module is: Rule.where)
        rule = next(
            (
                r
                for r in table.linears
                if r.path == path and r.applies(lambda p: has_path(block, p))
            ),
            None,
        )
        if rule is None:
            if not any(is_under(path, r) for r in table.replicated):
                raise ExoTpError(
                    f"adapter on {prefix}.{path}: the {table.model_types[0]} "
                    f"tensor-parallel table neither splits nor replicates it"
                )
        elif rule.style == "column":
            b = _take(b, 1, mine.rule(rule)[0])
        elif rule.style == "row":
            a = _take(a, 0, mine.rule(rule)[0])
        else:
            raise ExoTpError(
                f"adapter on {prefix}.{path}: LoRA on a per-head stack is not supported"
            )
        base = parent[name]
        lora = LoRALinear.from_base(base, r=adapter.rank, scale=adapter.scale)
        if lora.lora_a.shape != a.shape or lora.lora_b.shape != b.shape:
            raise ExoTpError(
                f"adapter on {prefix}.{path}: shapes {tuple(a.shape)} and "
                f"{tuple(b.shape)} do not fit the model's linear"
            )
        lora.lora_a, lora.lora_b = mx.contiguous(a), mx.contiguous(b)
        setattr(parent, name, lora)


def _parent(block: nn.Module, path: str) -> tuple[nn.Module | None, str]:
    """The module holding ``path``'s last component, looking through all-reduce wrappers."""
    head, _, name = path.rpartition(".")
    if head and not has_path(block, head):
        return None, name
    parent = get_path(block, head) if head else block
    while isinstance(parent, PartialSum):
        parent = parent.inner
    return (parent, name) if name in parent else (None, name)


def _take(x: mx.array, axis: int, ranges: Ranges) -> mx.array:
    parts = [mx.take(x, mx.arange(a, b), axis=axis) for a, b in ranges]
    return mx.concatenate(parts, axis=axis)
