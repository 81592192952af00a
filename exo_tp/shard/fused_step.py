"""A step's decode rows and one prompt chunk in one forward pass (chunked prefill, issue #43).

mlx-lm's `BatchGenerator` runs a step as two model calls: the decoding streams' rows with their
batch cache, then the waiting prompt's chunk with its own. On a CPU each call reads every
weight and waits on every all-reduce, so a step with a chunk costs about a decode step plus
the chunk's own step. Where the architecture's blocks have the plain pre-norm shape
(`ArchTable.fused`), one pass serves both: in each block the two row sets are joined for the
norms, the MLP and both all-reduces (each weight read once, each collective once), and only
attention runs apart, each row set with its own mask and cache. A row's values are the same
products as in a pass of its own; only a product's blocking over more rows may move its last
bits, as batching does.

Without rewriting the model's forward: the model's own code runs twice over its layer list,
with stand-ins in place of the blocks. First the chunk's pass through the layer stack (nothing
of it is evaluated): the stand-ins record what each block is called with (the first block's
input is the chunk's embedding, however the model computes it; each block gets its mask and
cache) and hand the input on unchanged. Then the decode rows' pass through the whole model:
each stand-in runs its block on both row sets (the rows' input from the model, the chunk's from
the stand-in before it) and returns the rows' output, which the model's final norm and head
turn into the rows' logits. The chunk's logits are never computed (mlx-lm's prompt call never
evaluates them either); its caches hold its keys and values as after mlx-lm's prompt call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn

from exo_tp.arch import table_for
from exo_tp.arch.table import FusedBlock
from exo_tp.shard.tree import get_path

# A block's work in a pass: (input, mask, cache) in, its output out.
BlockCall = Callable[[mx.array, Any, Any], mx.array]


class _Parts(NamedTuple):
    """A block's modules a fused pass calls (its FusedBlock paths, looked up once)."""

    attention: Any  # PartialSum
    mlp: Any  # PartialSum
    attention_norm: nn.Module
    mlp_norm: nn.Module

    @classmethod
    def of(cls, block: nn.Module, shape: FusedBlock) -> _Parts:
        paths = (shape.attention, shape.mlp, shape.attention_norm, shape.mlp_norm)
        return cls(*(get_path(block, path) for path in paths))


class _StandIn:
    """A block's place in the layer list during a pass. Reads fall through to the block
    (model code reads block attributes, as llama's ``use_sliding``)."""

    def __init__(self, block: nn.Module, call: BlockCall):
        self._block, self._call = block, call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._block, name)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        return self._call(x, mask, cache)


@contextmanager
def _standing_in(layers: list[Any], stand_ins: list[_StandIn]) -> Iterator[None]:
    saved = list(layers)
    layers[:] = stand_ins
    try:
        yield
    finally:
        layers[:] = saved


def _rows(x: mx.array) -> mx.array:
    return x.reshape(-1, x.shape[-1])


class FusedForward:
    """Runs a step's decode rows and a prompt chunk through a model in one pass (module doc)."""

    def __init__(self, model: nn.Module, model_type: str):
        table = table_for(model_type)
        if table.fused is None:
            raise ValueError(f"{model_type}: its blocks do not fuse")
        self._model = model
        self._stack = get_path(model, table.stack)
        self._layers: list[Any] = get_path(model, table.layers)
        self._parts = [_Parts.of(block, table.fused) for block in self._layers]

    def __call__(
        self, rows: mx.array, rows_cache: list[Any], chunk: mx.array, chunk_cache: list[Any]
    ) -> mx.array:
        """The decode rows' logits (``rows``: (B, 1) tokens); the chunk ((1, C) tokens) goes
        into ``chunk_cache`` on the way, its logits never computed."""
        seen: list[tuple[mx.array, Any, Any]] = []

        def record(x: mx.array, mask: Any, cache: Any) -> mx.array:
            seen.append((x, mask, cache))
            return x

        with _standing_in(self._layers, [_StandIn(b, record) for b in self._layers]):
            self._stack(chunk, cache=chunk_cache)
        hidden = [seen[0][0]]  # the chunk's hidden state between blocks

        def fused(index: int) -> BlockCall:
            def call(x: mx.array, mask: Any, cache: Any) -> mx.array:
                _, chunk_mask, chunk_cache = seen[index]
                x, hidden[0] = _block(
                    self._parts[index], (x, mask, cache), (hidden[0], chunk_mask, chunk_cache)
                )
                return x

            return call

        stand_ins = [_StandIn(b, fused(i)) for i, b in enumerate(self._layers)]
        with _standing_in(self._layers, stand_ins):
            return self._model(rows, cache=rows_cache)


def _block(
    parts: _Parts, mine: tuple[mx.array, Any, Any], chunk: tuple[mx.array, Any, Any]
) -> tuple[mx.array, mx.array]:
    """``h = x + attention(norm(x))``, ``h + mlp(norm(h))`` for both row sets at once."""
    attention, mlp = parts.attention, parts.mlp
    (x, mask, cache), (y, y_mask, y_cache) = mine, chunk
    split = x.shape[0] * x.shape[1]
    joined = mx.concatenate([_rows(x), _rows(y)])
    normed = parts.attention_norm(joined)
    partials = [
        attention.partial(normed[:split].reshape(x.shape), mask, cache),
        attention.partial(normed[split:].reshape(y.shape), y_mask, y_cache),
    ]
    h = joined + attention.reduce(mx.concatenate([_rows(p) for p in partials]))
    h = h + mlp.reduce(mlp.partial(parts.mlp_norm(h)[None]))[0]
    return h[:split].reshape(x.shape), h[split:].reshape(y.shape)
