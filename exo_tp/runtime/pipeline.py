"""Running a pipeline plan: stage servers, and the last stage's view of the whole model.

The last stage drives generation with mlx-lm's own loop (``generate``). Its model is
``PipelineTail``: each forward sends the input tokens to stage 0, receives the hidden state from
the stage before it, and runs its own layers, norm and LM head. The other stages serve those
frames in order; a new KV cache in the driver resets theirs. Inside every stage, the ranks form
their own MLX group for tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from exo_tp.plan.pipeline import PipelinePlan
from exo_tp.runtime.hops import Frame, HopIn, HopOut, open_hops


class PipelineTail(nn.Module):
    def __init__(self, model: nn.Module, incoming: HopIn, outgoing: HopOut | None):
        super().__init__()
        self.model = model
        self._incoming, self._outgoing = incoming, outgoing
        self._cache_id: int | None = None

    @property
    def layers(self) -> list[Any]:
        return self.model.layers

    def make_cache(self) -> list[Any]:
        return make_prompt_cache(self.model)

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        if cache is None or id(cache) != self._cache_id:  # a new request: fresh caches upstream
            self._cache_id = None if cache is None else id(cache)
            if self._outgoing is not None:
                self._outgoing.send(Frame("reset"))
        mx.eval(inputs)
        if self._outgoing is not None:  # only the stage's first rank feeds stage 0
            self._outgoing.send(Frame("tokens", inputs.astype(mx.int32)))
        frame = self._incoming.recv()
        if frame is None or frame.array is None:
            raise RuntimeError("the previous pipeline stage went away")
        return self.model(inputs, cache=cache, input_embeddings=frame.array)


def serve_stage(model: nn.Module, incoming: HopIn, outgoing: HopOut | None,
                forward_resets: bool) -> None:
    """A stage before the last: run its layers on every frame until the link closes."""
    cache: list[Any] | None = None
    inner = model.model
    while (frame := incoming.recv()) is not None:
        if frame.kind == "reset":
            cache = make_prompt_cache(model)
            if outgoing is not None and forward_resets:
                outgoing.send(frame)
            continue
        assert frame.array is not None
        if frame.kind == "tokens":
            hidden = inner(frame.array, cache)
        else:
            dummy = mx.zeros(frame.array.shape[:2], dtype=mx.int32)
            hidden = inner(dummy, cache, input_embeddings=frame.array)
        mx.eval(hidden)
        if outgoing is not None:
            outgoing.send(Frame("hidden", hidden))


def stage_driver(model: nn.Module, plan: PipelinePlan, rank: int, hops: Sequence[str],
                 timeout: float, before_serving: Callable[[], None] = lambda: None,
                 ) -> nn.Module | None:
    """What rank ``rank`` generates with: its model alone (one stage), the last stage's
    ``PipelineTail``, or None for an earlier stage once it has served until the link closed
    (``before_serving`` runs as it starts serving)."""
    index, local = plan.locate(rank)
    stages = plan.stages
    if len(stages) == 1:
        return model
    after = stages[(index + 1) % len(stages)]
    targets = [hops[r] for r in after.ranks] if local == 0 else []
    incoming, outgoing = open_hops(hops[rank], targets, True, timeout)
    assert incoming is not None
    if index < len(stages) - 1:
        before_serving()
        serve_stage(model, incoming, outgoing, forward_resets=index + 1 < len(stages) - 1)
        return None
    return PipelineTail(model, incoming, outgoing)
