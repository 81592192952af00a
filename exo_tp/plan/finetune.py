"""How a fine-tuning job is cut across uneven ranks (pure: no MLX).

- **Base weights** are cut along dim 0 (output rows; vocabulary rows of an embedding), each
  rank holding a contiguous run of rows in proportion to its memory weight, in whole granules
  (1 row for float and affine-quantized weights: every row of a packed weight, its scales and
  biases stands alone, so any row boundary is bit-exact). Row-parallel linears (o_proj,
  down_proj) are cut by input columns instead, in runs of the serving cut's finest intervals
  (`exo_tp.finetune.columns`). The all-gather pads every rank's run to the largest one: MLX
  collectives need equal shapes.
- **Micro-batches** follow speed: rank r takes a contiguous run of each global batch's rows in
  proportion to its speed weight, at least one row each (every rank runs the same graph, and an
  empty batch has no shape MLX kernels accept).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field, model_validator

from exo_tp.errors import ExoTpError
from exo_tp.frozen import Frozen
from exo_tp.plan.apportion import contiguous_spans, largest_remainder, normalize
from exo_tp.plan.shard_plan import Span


class RowSplit(Frozen):
    """One tensor's dim 0 (or a column cut's intervals) cut into one contiguous span per
    rank."""

    rows: int = Field(ge=0)
    spans: tuple[Span, ...]

    @model_validator(mode="after")
    def _covers(self) -> RowSplit:
        start = 0
        for span in self.spans:
            if span.start != start:
                raise ValueError(f"row spans {self.spans} are not consecutive")
            start = span.stop
        if start != self.rows:
            raise ValueError(f"row spans {self.spans} do not cover {self.rows} rows")
        return self

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(s.size for s in self.spans)

    @property
    def padded(self) -> int:
        """Rows every rank sends to the all-gather (the largest share)."""
        return max(self.sizes)

    @property
    def padding(self) -> tuple[int, ...]:
        return tuple(self.padded - s for s in self.sizes)


def split_rows(rows: int, weights: Sequence[float], granule: int = 1) -> RowSplit:
    """Rows of a tensor by weight, in whole granules (the last granule may stop short)."""
    if granule < 1:
        raise ExoTpError(f"row granule must be at least 1, got {granule}")
    units = -(-rows // granule)
    counts = largest_remainder(units, weights)
    return RowSplit(rows=rows, spans=contiguous_spans(counts, granule, rows))


def batch_rows(batch_size: int, speeds: Sequence[float]) -> tuple[Span, ...]:
    """Each rank's rows of a global batch, in proportion to its speed, at least one each."""
    n = len(speeds)
    if batch_size < n:
        raise ExoTpError(
            f"--batch-size {batch_size} is smaller than the {n} ranks: every rank "
            f"needs at least one sequence per step"
        )
    if any(s <= 0 for s in normalize(speeds)):
        raise ExoTpError(f"every rank needs a positive speed weight, got {list(speeds)}")
    # One row each first, the rest by largest remainder of what each share still lacks.
    shares = normalize(speeds)
    wanted = [max(batch_size * s - 1, 0.0) for s in shares]
    extra = largest_remainder(batch_size - n, wanted) if batch_size > n else (0,) * n
    return contiguous_spans([1 + e for e in extra], 1, batch_size)


class FinetunePlan(Frozen):
    """The cut of one job: who holds how much of the base, who computes how much of a batch."""

    memory_weights: tuple[float, ...]
    speed_weights: tuple[float, ...]
    batch_size: int = Field(ge=1)
    batch: tuple[Span, ...]
    granule: int = Field(default=1, ge=1)

    @property
    def size(self) -> int:
        return len(self.memory_weights)

    def rows(self, rows: int) -> RowSplit:
        return split_rows(rows, self.memory_weights, self.granule)

    def units(self, units: int) -> RowSplit:
        """A column cut's intervals (``exo_tp.finetune.columns``) by memory weight."""
        return split_rows(units, self.memory_weights)


def plan_finetune(
    memory_weights: Sequence[float],
    speed_weights: Sequence[float],
    batch_size: int,
    granule: int = 1,
) -> FinetunePlan:
    if len(memory_weights) != len(speed_weights):
        raise ExoTpError(
            f"{len(memory_weights)} memory weights for {len(speed_weights)} speed weights"
        )
    normalize(memory_weights)  # one readable error for negative, NaN or all-zero weights
    return FinetunePlan(
        memory_weights=tuple(memory_weights),
        speed_weights=tuple(speed_weights),
        batch_size=batch_size,
        batch=batch_rows(batch_size, speed_weights),
        granule=granule,
    )
