"""Pipeline stages of a model whose layers hand on more than one hidden state (DeepSeek V4.1).

Its layers pass ``hc_mult`` residual streams and the mix that collapses them, and a forward
pass's shared state: the compressed KV and index keys a source layer adds, the top-k selections
an index layer makes for the layers after it, the candidate blocks one layer picks. mlx-lm's
own ``pipeline()`` for it sends these as one message per step between ring neighbours; its
module has the message's layout and packing (``_crossing``, ``_layout``, ``_pack``,
``_unpack``). Here the same message travels as the stage's "hidden state" over the engine's
hops (exo_tp.runtime.pipeline.StageModel, unchanged): the last block of a stage before the last
packs it (``SendState``) and the stage returns it in place of its final norm's output
(``StateMessage``); a later stage's embedding (``StreamsFeed``, a HiddenFeed) takes it and hands
the model a placeholder, and its first block (``ReceiveState``) unpacks it into the streams,
the mix, its cache and the shared state. Under the runtime's batch a model of this kind runs one
sequence at a time (exo_tp.shard.sequences): a batch's message is its sequences' messages back
to back, each sized by its own length and position, which both stages know.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from exo_tp.arch import ArchTable
from exo_tp.errors import ExoTpError
from exo_tp.plan import ShardPlan, Span
from exo_tp.shard.layers import HiddenFeed, Wrapper
from exo_tp.shard.tree import flat_items, get_path, set_path


class StageLink:
    """The message a stage receives (read in order, one sequence after another) and the
    messages its last block packed for the next stage."""

    def __init__(self) -> None:
        self.inbox: mx.array | None = None
        self.read = 0
        self.outbox: list[mx.array] = []

    def take(self, size: int) -> mx.array:
        if self.inbox is None or self.read + size > self.inbox.size:
            raise RuntimeError("the previous pipeline stage's message is shorter than expected")
        part = self.inbox[self.read : self.read + size]
        self.read += size
        return part


class StreamsFeed(HiddenFeed):
    """A later stage's embedding: the previous stage's message goes to the stage's first block
    (``ReceiveState``); the model gets zeros of its hidden width to build (and then replace)
    its streams from."""

    def __init__(self, embedding: nn.Module, link: StageLink, width: int, dtype: mx.Dtype):
        super().__init__(embedding)
        self._link, self._width, self._dtype = link, width, dtype

    def __call__(self, inputs: mx.array) -> mx.array:
        message, self._next.value = self._next.value, None
        if message is not None:  # once per batch; each sequence's pass reads its own part
            self._link.inbox, self._link.read = message.reshape(-1), 0
        return mx.zeros((*inputs.shape, self._width), self._dtype)


class ReceiveState(Wrapper):
    """A later stage's first block: its streams, mix and the shared state it and the blocks
    after it read from earlier stages come from the message (as mlx-lm's ``_receive`` takes
    them from a ring neighbour)."""

    def __init__(
        self, inner: nn.Module, link: StageLink, family: ModuleType, args: Any, start: int
    ):
        super().__init__(inner)
        self._link, self._family, self._args = link, family, args
        self._crossing = family._crossing(args, start)

    def __call__(
        self,
        streams: mx.array,
        pre_mix: mx.array,
        *,
        start_pos: int,
        cache: Any,
        shared: dict[str, Any],
        **kwargs: Any,
    ) -> tuple[mx.array, mx.array]:
        f, args = self._family, self._args
        batch, length = streams.shape[:2]
        layout = f._layout(args, self._crossing, batch, length, start_pos, streams.dtype)
        size = sum(f._nbytes(shape, dtype) for _, shape, dtype in layout)
        parts = f._unpack(self._link.take(size), layout)
        streams, pre_mix = parts.pop("streams"), parts.pop("pre_mix")
        for key, part in parts.items():
            if key in f._CACHE_FIELDS:
                # this block never writes the field: it keeps the source stage's entries
                if part.shape[1]:
                    setattr(cache, key, f._append(getattr(cache, key), part))
                shared[key] = getattr(cache, key)
            elif key == "candidates":
                keys = f._index_keys(args, self._crossing[key], start_pos + length)
                mask = mx.repeat(part, args.candidate_block_size, axis=-1)
                shared[key] = mask[..., :keys] if keys else None
            else:
                shared[key] = part
        return self.inner(
            streams, pre_mix, start_pos=start_pos, cache=cache, shared=shared, **kwargs
        )


class SendState(Wrapper):
    """An earlier stage's last block: after it runs, its streams, mix and the shared state the
    next stages read are packed into this sequence's message (as mlx-lm's ``_send`` does)."""

    def __init__(self, inner: nn.Module, link: StageLink, family: ModuleType, args: Any, stop: int):
        super().__init__(inner)
        self._link, self._family, self._args = link, family, args
        self._crossing = family._crossing(args, stop)

    def __call__(
        self,
        streams: mx.array,
        pre_mix: mx.array,
        *,
        start_pos: int,
        shared: dict[str, Any],
        **kwargs: Any,
    ) -> tuple[mx.array, mx.array]:
        f, args = self._family, self._args
        streams, pre_mix = self.inner(
            streams, pre_mix, start_pos=start_pos, shared=shared, **kwargs
        )
        batch, length = streams.shape[:2]
        layout = f._layout(args, self._crossing, batch, length, start_pos, streams.dtype)
        state = {**shared, "streams": streams, "pre_mix": pre_mix}
        parts = []
        for key, shape, dtype in layout:
            part = state.get(key)
            if part is None:  # not written yet, so the layout has no entries either
                part = mx.zeros(shape, dtype)
            elif key in f._CACHE_FIELDS:  # all entries so far: only the new ones go
                part = part[:, part.shape[1] - shape[1] :]
            elif key == "candidates":
                part = part[..., :: args.candidate_block_size]
            if part.shape != shape or part.dtype != dtype:
                raise RuntimeError(f"the next stage expects {key} as {dtype} {shape}")
            parts.append(part)
        self._link.outbox.append(f._pack(parts))
        return streams, pre_mix


class StateMessage(nn.Module):
    """The final norm of a stage before the last: the stage's output is the message its last
    block packed (the collapsed streams it is handed are not what the next stage needs)."""

    def __init__(self, link: StageLink):
        super().__init__()
        self._link = link

    def __call__(self, x: mx.array) -> mx.array:
        messages, self._link.outbox = self._link.outbox, []
        return mx.concatenate(messages) if len(messages) > 1 else messages[0]


def link_stages(
    model: nn.Module,
    table: ArchTable,
    plan: ShardPlan,
    layers: Span,
    first: bool,
    last: bool,
    dtype: mx.Dtype | None,
) -> None:
    """Give a stage of such a model (not the whole model) its ends: see the module's docstring.
    Its message is sent by the stage's first rank holding heads (exo_tp.plan.pipeline
    Stage.sender): attention makes the compressed KV and the selections, and a rank without
    heads skips it."""
    if not any(r.heads.q_heads.size for r in plan.ranks):
        raise ExoTpError(f"{plan.spec.model_type}: a pipeline stage holds no attention heads")
    family = importlib.import_module(type(model).__module__)
    args = model.args
    blocks = get_path(model, table.layers)
    link = StageLink()
    if not first:
        blocks[0] = ReceiveState(blocks[0], link, family, args, layers.start)
        feed = get_path(model, table.embedding)
        compute = dtype or _compute_dtype(model)
        set_path(
            model,
            table.embedding,
            StreamsFeed(feed.embedding, link, plan.spec.hidden_size, compute),
        )
    if not last:
        blocks[-1] = SendState(blocks[-1], link, family, args, layers.stop)
        set_path(model, table.norm, StateMessage(link))


def _compute_dtype(model: nn.Module) -> mx.Dtype:
    """The activations' dtype where the shard keeps its checkpoint's: that of the parameters
    the model's cast_predicate lets follow the compute dtype."""
    keep = getattr(model, "cast_predicate", lambda _: True)
    for name, value in flat_items(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating) and keep(name):
            return value.dtype
    return mx.float32
