"""Every rank but the conductor: apply the conductor's changes at the agreed steps and step
the same batch (see `exo_tp.runtime.batching`). Between requests they sleep in a socket read."""

from __future__ import annotations

from collections import deque

import mlx.core as mx

from exo_tp.runtime.batching import DivergedError, LockstepBatch, RankSampler, Word
from exo_tp.shard.collectives import broadcast_from_first, zeros_after
from exo_tp.transport.channel import Channel
from exo_tp.transport.ring import leave
from exo_tp.wire.runtime import Drafts, EndTokens, Insert, Remove, Tokens


class EpochOver(Exception):
    """The conductor closed its link: the epoch ended."""


class ControlFeed:
    """The conductor's link as this rank reads it: changes in order, and (earlier pipeline
    stages) the tokens of each step."""

    def __init__(self, channel: Channel[Insert | Remove | Tokens | Drafts | EndTokens]):
        self._channel = channel
        self._changes: deque[Insert | Remove] = deque()

    def _read(self) -> Insert | Remove | Tokens | Drafts | EndTokens:
        message = self._channel.recv()
        if message is None:
            raise EpochOver
        return message

    def end_tokens(self) -> EndTokens:
        """The link's first message: the tokens that end a sequence (and how drafts come)."""
        message = self._read()
        if not isinstance(message, EndTokens):
            raise DivergedError(
                f"the conductor's first message is {message.kind}, not its end tokens"
            )
        return message

    def next_change(self) -> Insert | Remove:
        while not self._changes:
            message = self._read()
            if isinstance(message, Tokens | Drafts | EndTokens):
                raise DivergedError(f"{message.kind} arrived where a change was due")
            self._changes.append(message)
        return self._changes.popleft()

    def next_tokens(self) -> Tokens:
        message = self._next_step_message()
        if not isinstance(message, Tokens):
            raise DivergedError("drafts arrived where a step's tokens were due")
        return message

    def next_drafts(self) -> Drafts:
        message = self._next_step_message()
        if not isinstance(message, Drafts):
            raise DivergedError("a step's tokens arrived where drafts were due")
        return message

    def _next_step_message(self) -> Tokens | Drafts:
        """The next message about a step; the changes read on the way are kept in order."""
        while True:
            message = self._read()
            if isinstance(message, Tokens | Drafts):
                return message
            if isinstance(message, EndTokens):
                raise DivergedError("end tokens arrived where a step's message was due")
            self._changes.append(message)


def peer_sampler(group: mx.distributed.Group) -> RankSampler:
    """The last stage's other ranks: contribute zeros to the conductor's token broadcast."""

    def sample(logprobs: mx.array) -> tuple[mx.array, Word]:
        mine = zeros_after((logprobs.shape[0] + 1,), mx.float32, logprobs)
        agreed = broadcast_from_first(mine, group)
        return agreed[:-1].astype(mx.uint32), agreed[-1]

    return sample


def stage_sampler(feed: ControlFeed) -> RankSampler:
    """Ranks of earlier pipeline stages: the tokens arrive from the conductor."""

    def sample(logprobs: mx.array) -> tuple[mx.array, Word]:
        message = feed.next_tokens()
        if len(message.tokens) != logprobs.shape[0]:
            raise DivergedError(f"{len(message.tokens)} tokens for {logprobs.shape[0]} rows")
        return mx.array(message.tokens, dtype=mx.uint32), message.committed

    return sample


def follow(batch: LockstepBatch, feed: ControlFeed, group: mx.distributed.Group) -> None:
    """Serve until the conductor closes its link."""
    try:
        while True:
            target = batch.agreed()
            while batch.applied < target:
                change = feed.next_change()
                if isinstance(change, Insert):
                    batch.insert(change)
                else:
                    batch.remove(change)
            if not batch.idle:
                batch.step()
    except EpochOver:
        if batch.idle:  # a normal end: every rank of the group is here too
            leave(group)
