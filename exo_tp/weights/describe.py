"""One tensor's manifest entry before its digests: where it is, and where it may be cut (pure)."""

from __future__ import annotations

from collections.abc import Callable

from exo_tp.arch import ArchTable
from exo_tp.plan.spec import ModelSpec
from exo_tp.weights.layout import locate, split_of, whole_cuts
from exo_tp.weights.manifest import ITEMSIZE, TensorEntry


def describe(
    name: str,
    file: str,
    offset: int,
    dtype: str,
    shape: tuple[int, ...],
    sliceable: bool,
    spec: ModelSpec,
    table: ArchTable,
    has: Callable[[str], bool] | None = None,
) -> TensorEntry:
    """The entry with its axis and block cuts (``digests`` left empty).

    A tensor the loader slices on disk is cut where any plan may cut it; any other is only
    moved whole and is cut along axis 0 into blocks of about a mebibyte. ``has``: whether the
    model holds a module path (see exo_tp.weights.layout.locate).
    """
    split = split_of(locate(name, table, has), shape, spec) if sliceable else None
    if split is None:
        axis, cuts = 0, whole_cuts(shape, ITEMSIZE[dtype])
    else:
        axis, cuts = split.axis, tuple(split.storage(p) for p in split.points)
    return TensorEntry(
        name=name,
        file=file,
        offset=offset,
        dtype=dtype,
        shape=shape,
        sliceable=sliceable,
        axis=axis,
        cuts=cuts,
        digests=(),
    )
