"""The leader's request source: the epoch's conductor connects here; requests go out as they
arrive (the conductor batches them, up to ``max_concurrency`` at once) and their events come
back. Beyond the batch, requests wait here in arrival order; beyond ``max_queue`` waiting they
are refused (`QueueFull`). A client that goes away cancels its request on every rank.

Failures are domain errors (`DispatchError`); the node's API backend (exo_tp.node.backend) is
the one place that turns them into HTTP errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from exo_tp.frozen import replace
from exo_tp.transport.channel import Channel, Listener
from exo_tp.wire.ids import Epoch
from exo_tp.wire.runtime import (
    CONDUCTOR_EVENTS,
    Cancel,
    Delta,
    Done,
    Generate,
    GenerateRequest,
    Hello,
    RequestFailed,
)

log = logging.getLogger(__name__)

HOLD_SECONDS = 180.0  # longest a request waits for a planned re-plan before a 503

ConductorChannel = Channel[Hello | Delta | Done | RequestFailed]


class DispatchError(Exception):
    """A request the dispatcher cannot run or finish."""


class NotReady(DispatchError):
    """No conductor serves requests now (the cluster forms, loads or failed)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class QueueFull(DispatchError):
    """``max_queue`` requests already wait beyond the batch."""

    def __init__(self, running: int, waiting: int):
        super().__init__(f"{running} running and {waiting} waiting")
        self.running, self.waiting = running, waiting

    @property
    def retry_after(self) -> int:
        """Seconds until a slot is likely free (a batch's worth of waiters per second)."""
        return max(1, self.waiting // self.running)


class KvCacheFull(DispatchError):
    """The running requests' contexts leave too little KV memory for this one's, now."""

    def __init__(self, needed: int, reserved: int, capacity: int):
        super().__init__(f"{needed} tokens of context wanted, {reserved} of {capacity} taken")
        self.needed, self.reserved, self.capacity = needed, reserved, capacity


class GenerationFailed(DispatchError):
    """The ranks reported a failure of this request."""

    def __init__(self, message: str, grammar: bool = False):
        super().__init__(message)
        self.message, self.grammar = message, grammar  # grammar: RequestFailed.grammar


class ClusterLost(DispatchError):
    """The epoch serving this request ended (``reason``) before the request did."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Dispatcher:
    def __init__(self, key: bytes, host: str, max_concurrency: int, max_queue: int):
        self._key, self._host = key, host
        self.max_concurrency, self.max_queue = max_concurrency, max_queue
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener: Listener[Any] | None = None
        self.expected_epoch: Epoch | None = None
        self.conductor: ConductorChannel | None = None  # serving
        self._arrived: ConductorChannel | None = None  # connected, not yet serving
        self.conductor_epoch: Epoch | None = None
        self.unavailable_reason = "the cluster is forming"
        self._slots = asyncio.Semaphore(max_concurrency)
        # Tokens of context the epoch's KV memory holds, all streams together (None: not
        # bounded), and what running requests reserved of it (prompt + max_tokens each), so
        # that a request is admitted only if its whole context fits and none runs out mid-way.
        self.kv_tokens: int | None = None
        self._reserved = 0
        self._waiting = 0
        self._streams: dict[str, asyncio.Queue[Delta | Done | DispatchError]] = {}
        self._ids = itertools.count()
        # Speculative decoding since the node started: tokens drafted, and accepted by the
        # model (the status's serving counters; Done carries each request's).
        self.drafted_tokens = self.accepted_tokens = 0
        self.on_conductor_lost: Callable[[Epoch], None] | None = None  # set by the leader
        # Monotonic time a request last started or ended (a model's idle time counts from it:
        # exo_tp.node.leader.keep_alive).
        self.last_active = time.monotonic()
        # Cleared during a planned re-plan (rebalancing): new requests wait, not 503.
        self._open = asyncio.Event()
        self._open.set()

    async def start(self) -> int:
        self._loop = asyncio.get_running_loop()
        self._listener = Listener(
            f"{self._host}:0", self._key, CONDUCTOR_EVENTS, self._on_channel, "requests"
        )
        return self._listener.port

    def stop(self) -> None:
        self.detach("the node is stopping")
        if self._listener is not None:
            self._listener.close()

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot in the batch."""
        return self._waiting

    # ---- the conductor's link (its events arrive on a listener thread) ---------------------

    def _on_channel(self, channel: ConductorChannel) -> None:
        assert self._loop is not None
        hello = channel.recv()
        if not isinstance(hello, Hello):
            channel.close()
            return
        self._loop.call_soon_threadsafe(self._offer, channel, hello.epoch)
        while (event := channel.recv()) is not None:
            self._loop.call_soon_threadsafe(self._on_event, channel, event)
        self._loop.call_soon_threadsafe(self._lost, channel, hello.epoch)

    def _offer(self, channel: ConductorChannel, epoch: Epoch) -> None:
        if epoch != self.expected_epoch:  # the conductor of an epoch this leader is not running
            channel.close()
            return
        if self.conductor is not None:
            self.conductor.close()
        if self._arrived is not None:
            self._arrived.close()
        self.conductor, self._arrived, self.conductor_epoch = None, channel, epoch

    def attach(self, epoch: Epoch) -> bool:
        """Serve through the conductor of ``epoch`` once it connected (False: not yet)."""
        channel = self._arrived
        if channel is None or self.conductor_epoch != epoch or channel.closed:
            return False
        self.conductor, self._arrived = channel, None
        return True

    def _lost(self, channel: ConductorChannel, epoch: Epoch) -> None:
        if channel is self.conductor or channel is self._arrived:
            self.conductor = self._arrived = None
            if self.on_conductor_lost is not None:
                self.on_conductor_lost(epoch)

    def _on_event(
        self,
        channel: ConductorChannel,
        event: Delta | Done | RequestFailed | Hello,
    ) -> None:
        if channel is not self.conductor or isinstance(event, Hello):
            return
        stream = self._streams.get(event.id)
        if stream is None:
            return
        if isinstance(event, RequestFailed):
            stream.put_nowait(GenerationFailed(event.message, event.grammar))
        else:
            stream.put_nowait(event)

    def detach(self, reason: str) -> None:
        """Stop serving: in-flight and queued requests fail with ``reason``."""
        if self.conductor is not None:
            self.conductor.close()
        self.conductor = None
        self.unavailable_reason = reason
        for stream in self._streams.values():
            stream.put_nowait(ClusterLost(reason))

    # ---- a planned re-plan ------------------------------------------------------------------

    def hold(self) -> None:
        """New requests wait (in the queue, up to ``HOLD_SECONDS``) instead of starting; those
        in flight finish. For a re-plan the leader chose: nothing fails."""
        self._open.clear()

    def resume(self) -> None:
        """Let waiting requests go: to the new epoch's conductor, or (if it failed) to a 503."""
        self._open.set()

    @property
    def held(self) -> bool:
        return not self._open.is_set()

    async def _wait_open(self) -> None:
        if self._open.is_set():
            return
        if self._waiting >= self.max_queue:
            raise QueueFull(self.max_concurrency, self._waiting)
        self._waiting += 1
        try:
            await asyncio.wait_for(self._open.wait(), HOLD_SECONDS)
        except TimeoutError:
            raise NotReady(self.unavailable_reason) from None
        finally:
            self._waiting -= 1

    # ---- requests --------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[Delta | Done, None]:
        """Events of one generation; closing the iterator early cancels it on every rank.
        Raises `NotReady`, `QueueFull`, `GenerationFailed` or `ClusterLost`."""
        await self._wait_open()
        if self.conductor is None:
            raise NotReady(self.unavailable_reason)
        if self._slots.locked() and self._waiting >= self.max_queue:
            raise QueueFull(self.max_concurrency, self._waiting)
        self._waiting += 1
        self.last_active = time.monotonic()
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        needed = len(request.tokens) + request.sampling.max_tokens
        if self.kv_tokens is not None and self._reserved + needed > self.kv_tokens:
            self._slots.release()
            raise KvCacheFull(needed, self._reserved, self.kv_tokens)
        self._reserved += needed
        request = replace(request, id=f"{request.id}-{next(self._ids)}")
        stream: asyncio.Queue[Delta | Done | DispatchError] = asyncio.Queue()
        conductor = self.conductor
        finished = False
        try:
            if conductor is None:
                raise NotReady(self.unavailable_reason)
            self._streams[request.id] = stream
            conductor.send(Generate(request=request))
            while True:
                event = await stream.get()
                if isinstance(event, DispatchError):
                    finished = True
                    raise event
                if isinstance(event, Done):
                    self.drafted_tokens += event.drafted_tokens
                    self.accepted_tokens += event.accepted_tokens
                yield event
                if isinstance(event, Done):
                    finished = True
                    return
        finally:
            self._streams.pop(request.id, None)
            self.last_active = time.monotonic()
            if not finished and conductor is not None and conductor is self.conductor:
                with contextlib.suppress(OSError):
                    conductor.send(Cancel(id=request.id))
            self._reserved -= needed
            self._slots.release()
