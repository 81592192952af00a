"""Which bytes of the model files one rank of a fine-tuning job reads (pure: no MLX).

A rank holds its share of every base linear and embedding (`exo_tp.finetune.model`) and every
other parameter whole. As `exo_tp.weights.transfer` moves file tensors in digest blocks along
their manifest axis:

- a tensor cut along axis 0 (the rows) takes the blocks covering its rows (a little more than
  its rows where a block straddles the boundary);
- a linear the manifest cuts along its input columns (a serving plan's row-parallel weights)
  is cut by columns for training too (`exo_tp.finetune.columns`): its parts take exactly the
  blocks of the rank's columns, and its bias (the full output width) is taken whole;
- a tensor the loader does not read as stored (``sliceable`` false) is taken whole, as for
  serving.

So a node that holds a serving shard fetches, of a column-cut weight, only the columns of its
training share it does not hold (``plan_shares`` subtracts what it holds).
"""

from __future__ import annotations

from exo_tp.finetune.columns import ColumnCut, column_cut
from exo_tp.plan.finetune import FinetunePlan
from exo_tp.weights.boxes import Boxes
from exo_tp.weights.manifest import ModelManifest, TensorEntry

ROW_PARTS = ("weight", "scales", "biases", "bias")


def _whole(entry: TensorEntry) -> tuple[int, int]:
    return (0, entry.length)


def manifest_column_cut(manifest: ModelManifest, module: str) -> ColumnCut | None:
    """The column cut of ``module`` as the manifest's entries describe it."""
    parts = {}
    for key in ROW_PARTS:
        entry = manifest.by_name.get(f"{module}.{key}")
        if entry is not None and entry.sliceable:
            parts[key] = (len(entry.shape), entry.axis, entry.cuts)
        elif entry is not None and key != "bias":
            return None  # moved whole only: the loader may not slice it on disk
    return column_cut(parts)


def _row_cut(entry: TensorEntry, manifest: ModelManifest) -> bool:
    """Whether the fine-tuning loader cuts this tensor by rows: a part of a module whose
    weight is a matrix."""
    module, _, part = entry.name.rpartition(".")
    if part not in ROW_PARTS or not entry.sliceable or not entry.shape:
        return False
    weight = manifest.by_name.get(f"{module}.weight")
    return weight is not None and len(weight.shape) >= 2 and weight.shape[0] == entry.shape[0]


def finetune_boxes(manifest: ModelManifest, plan: FinetunePlan, rank: int) -> Boxes:
    pairs: list[tuple[str, list[tuple[int, int]]]] = []
    columns: dict[str, ColumnCut | None] = {}
    for entry in manifest.tensors:
        if not entry.length:
            continue
        module, _, part = entry.name.rpartition(".")
        if part in ROW_PARTS and module not in columns:
            columns[module] = manifest_column_cut(manifest, module)
        cut = columns.get(module) if part in ROW_PARTS else None
        if cut is not None:
            if part in cut.points:
                start, stop = cut.span(part, plan.units(cut.units).spans[rank])
                if stop > start:
                    pairs.append((entry.name, [(start, stop)]))
            else:  # the bias: whole on every rank
                pairs.append((entry.name, [_whole(entry)]))
            continue
        if not _row_cut(entry, manifest) or entry.axis != 0:
            pairs.append((entry.name, [_whole(entry)]))
            continue
        span = plan.rows(entry.shape[0]).spans[rank]
        if span.size == 0:
            continue
        # widen to whole digest blocks: a piece is checked block by block
        lo = max(c for c in entry.cuts if c <= span.start)
        hi = min(c for c in entry.cuts if c >= span.stop)
        pairs.append((entry.name, [(lo, hi)]))
    return Boxes.of(pairs)
