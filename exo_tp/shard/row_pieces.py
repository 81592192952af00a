"""One-row float32 products in pieces of rows, where OpenBLAS reads small weights twice as fast.

A decode step at batch 1 multiplies one activation row by each weight (``x @ W.T``, W stored
(N, K)). On Linux MLX hands that to the preloaded OpenBLAS's ``cblas_sgemm`` (exo_tp.process.blas).
On the 2-core Xeon VM OpenBLAS 0.3.21 streams a weight of up to about 3 MB at ~1.0e-10 s a byte,
near the core's memory speed, and a bigger one at 1.6-2.7e-10 (one thread, weights beyond the
caches; the step lies between 2.6 and 4.2 MB; docs/benchmarks.md, "Row pieces"). SmolLM2's FFN
gate and up (576 -> 1536, 3.5 MB) and its LM head (576 -> 49152, 113 MB) took half a decode
step. Split into pieces of at most ``PIECE_BYTES``, the same products run at the small
weights' speed, and the outputs are joined. Each output element is still one dot product over
K, summed by another kernel, so results differ from the whole product in the last bits (as a
tensor-parallel split's do), never more.

With two or more rows (batched decode, prefill) the whole product is as fast or faster, and
quantized products do not go through BLAS: both are left alone. Only where OpenBLAS is
preloaded on the CPU device, and not with ``EXO_TP_ROW_PIECES=0``.
"""

from __future__ import annotations

import math
import os

import mlx.core as mx
import mlx.nn as nn

from exo_tp.process.blas import PRELOADED_ENV

PIECES_ENV = "EXO_TP_ROW_PIECES"
PIECE_BYTES = 2 * 2**20  # under the 2.6-4.2 MB where one-row products slow down


def pieces_wanted() -> bool:
    """Whether this process multiplies one-row float32 products in pieces."""
    return (
        os.environ.get(PIECES_ENV, "1") != "0"
        and PRELOADED_ENV in os.environ
        and mx.default_device() == mx.cpu
    )


def piece_rows(weight: mx.array) -> int | None:
    """Rows per piece for a float32 weight (N, K) too big for one; None to keep it whole."""
    if weight.dtype != mx.float32 or weight.ndim != 2:
        return None
    n, k = weight.shape
    most = max(1, PIECE_BYTES // (k * weight.itemsize))  # rows that fit in one piece
    pieces = math.ceil(n / most)
    return math.ceil(n / pieces) if pieces > 1 else None  # as even as that many allow


def one_row(x: mx.array) -> bool:
    """Whether ``x`` holds a single activation row (batch 1, one token): what pieces are for."""
    return x.size == x.shape[-1]


def product(x: mx.array, weight: mx.array, rows: int | None) -> mx.array:
    """``x @ weight.T``, in pieces of ``rows`` output rows when x is one row."""
    if rows is None or not one_row(x):
        return x @ weight.T
    n = weight.shape[0]
    return mx.concatenate([x @ weight[i : i + rows].T for i in range(0, n, rows)], axis=-1)


class PiecedLinear(nn.Linear):
    """An `nn.Linear` whose one-row products go in pieces (same parameters, same paths)."""

    def __call__(self, x: mx.array) -> mx.array:
        # Two rows or more (prefill, batched decode, most calls) skip the piece arithmetic.
        rows = piece_rows(self["weight"]) if one_row(x) else None
        if rows is None:
            return super().__call__(x)  # exactly nn.Linear's product
        out = product(x, self["weight"], rows)
        return out + self["bias"] if "bias" in self else out


class PiecedEmbedding(nn.Embedding):
    """An `nn.Embedding` whose use as a tied LM head goes in pieces; lookups unchanged."""

    def as_linear(self, x: mx.array) -> mx.array:
        return product(x, self["weight"], piece_rows(self["weight"]))


_PIECED: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: PiecedLinear,
    nn.Embedding: PiecedEmbedding,
}


def multiply_in_pieces(model: nn.Module) -> int:
    """Give every float32 linear and embedding of ``model`` with a weight over ``PIECE_BYTES``
    its pieced class (exact types only: quantized layers and other subclasses keep theirs; the
    linear inside a LoRA layer is pieced like any other); returns how many were."""
    changed = 0
    for _, module in model.named_modules():
        pieced = _PIECED.get(type(module))
        if pieced is not None and piece_rows(module["weight"]) is not None:
            module.__class__ = pieced
            changed += 1
    return changed
