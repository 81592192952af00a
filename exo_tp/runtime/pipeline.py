"""Pipeline stages as models the batch generator can drive.

Every stage runs the same generator (see `exo_tp.runtime.batching`), so each forward call of the
generator happens on every stage in the same order: a stage's model takes the hidden state the
previous stage's sender (its first rank, exo_tp.plan.pipeline.hop_sender) sent for this call
(or, on stage 0, embeds the tokens), runs its
layers and sends the result on to every rank of the next stage. The last stage ends with the norm
and the LM head and returns the logits the conductor samples from; earlier stages return a
placeholder of shape (B, L, 1), as their tokens come from the conductor. Inside every stage the
ranks form their own MLX group for tensor parallelism. One batch is in flight across the stages
at a time.

Hops are channels (`exo_tp.transport.channel`): a typed header, then the activation's raw bytes.
bfloat16 travels as float32 (numpy has no bfloat16; the round trip is exact).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from exo_tp.shard.layers import HiddenFeed
from exo_tp.transport.channel import Channel
from exo_tp.wire.runtime import Hello, HiddenHeader

HopChannel = Channel[Hello | HiddenHeader]


def send_hidden(channel: HopChannel, hidden: mx.array) -> None:
    cast = str(hidden.dtype).split(".")[-1]
    data = np.array(hidden.astype(mx.float32) if hidden.dtype == mx.bfloat16 else hidden)
    channel.send(
        HiddenHeader(shape=data.shape, dtype=str(data.dtype), cast=cast), raw=data.tobytes()
    )


def recv_hidden(channel: HopChannel) -> mx.array:
    header = channel.recv()
    raw = channel.recv_raw() if isinstance(header, HiddenHeader) else None
    if raw is None or not isinstance(header, HiddenHeader):
        raise ConnectionError("the previous pipeline stage went away")
    data = np.frombuffer(raw, dtype=header.dtype).reshape(header.shape)
    return mx.array(data).astype(getattr(mx, header.cast))


class StageModel(nn.Module):
    """One pipeline stage of a rank: its shard of its layers, fed by the previous stage's hop
    (``incoming``; None on stage 0) and feeding the next stage's ranks (``outgoing``: only the
    stage's sender sends, see exo_tp.plan.pipeline.hop_sender).

    ``inner`` is the model's layer stack with its embedding (where ``model.layers`` live): a
    stage before the last runs only that (its final norm is an identity). A later stage's
    embedding is a `HiddenFeed`, handed the received hidden state before each call."""

    def __init__(
        self,
        model: nn.Module,
        inner: nn.Module,
        incoming: HopChannel | None,
        outgoing: list[HopChannel],
        last: bool,
        feed: HiddenFeed | None,
    ):
        super().__init__()
        self.model = model
        self._inner = inner
        self._incoming, self._outgoing, self._last = incoming, outgoing, last
        self._feed = feed

    @property
    def layers(self) -> list[Any]:
        return self.model.layers

    @property
    def holds_head(self) -> bool:
        """The last stage's: its forward ends in the LM head (earlier ones return nothing)."""
        return self._last

    def make_cache(self) -> list[Any]:
        return make_prompt_cache(self.model)

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        if self._incoming is not None and self._feed is not None:
            self._feed.feed(recv_hidden(self._incoming))
        if self._last:
            return self.model(inputs, cache=cache)
        hidden = self._inner(inputs, cache=cache)  # by name: MiniMax takes a mask before it
        mx.eval(hidden)
        for channel in self._outgoing:
            send_hidden(channel, hidden)
        return mx.zeros((*inputs.shape, 1), dtype=mx.float32)
