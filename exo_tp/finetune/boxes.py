"""Which bytes of the model files one rank of a fine-tuning job reads (pure: no MLX).

A rank holds the rows ``plan.rows(rows).spans[rank]`` of every base linear and embedding (weight,
quantization scales and biases, bias: `exo_tp.finetune.model`) and every other parameter whole.
As `exo_tp.weights.transfer` moves file tensors in digest blocks along their manifest axis:

- a tensor cut along axis 0 (the rows) takes the blocks covering its rows (a little more than
  its rows where a block straddles the boundary);
- a tensor the manifest cuts along another axis (a serving plan's row-parallel weights, whose
  blocks run along the input columns) is taken whole: its rows are no box;
- a tensor the loader does not read as stored (``sliceable`` false) is taken whole, as for
  serving.
"""

from __future__ import annotations

from exo_tp.finetune.plan import FinetunePlan
from exo_tp.weights.boxes import Boxes
from exo_tp.weights.manifest import ModelManifest, TensorEntry

ROW_PARTS = ("weight", "scales", "biases", "bias")


def _whole(entry: TensorEntry) -> tuple[int, int]:
    return (0, entry.length)


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
    for entry in manifest.tensors:
        if not entry.length:
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
