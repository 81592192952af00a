"""Leader side of generation: requests queue FIFO and run one at a time through rank 0."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from exo_tp.api.errors import ApiError
from exo_tp.runtime.messages import Delta, Done, GenerateRequest

MAX_WAITING = 64


class Conductor(Protocol):
    """Where requests go: the conductor worker's link (send returns False once it is gone)."""

    def send(self, message: dict[str, Any]) -> bool: ...


@dataclass
class _Pending:
    events: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)


class Dispatcher:
    def __init__(self) -> None:
        self.conductor: Conductor | None = None
        self.unavailable_reason = "the cluster is forming"
        self._slot = asyncio.Lock()  # FIFO: asyncio wakes waiters in arrival order
        self._waiting = 0
        self._pending: dict[str, _Pending] = {}
        self._ids = itertools.count()
        self.served = 0

    @property
    def busy(self) -> int:
        return self._waiting + len(self._pending)

    def attach(self, conductor: Conductor) -> None:
        self.conductor = conductor

    def detach(self, reason: str) -> None:
        """Stop serving: in-flight and queued requests fail with ``reason``."""
        self.conductor = None
        self.unavailable_reason = reason
        self.fail_all(reason)

    def fail_all(self, reason: str) -> None:
        for pending in self._pending.values():
            pending.events.put_nowait(ApiError(503, f"generation failed: {reason}",
                                               kind="server_error", code="cluster_failure"))

    def on_worker_event(self, event: dict[str, Any]) -> None:
        pending = self._pending.get(event.get("id", ""))
        if event["type"] == "delta" and pending:
            pending.events.put_nowait(Delta.model_validate(
                {k: v for k, v in event.items() if k != "type"}))
        elif event["type"] == "done" and pending:
            usage = event["usage"]
            pending.events.put_nowait(Done(
                id=event["id"], finish_reason=event["finish_reason"],
                stop_string=event.get("stop_string"),
                prompt_tokens=usage["prompt_tokens"],
                completion_tokens=usage["completion_tokens"], seconds=event["seconds"]))
        elif event["type"] in ("error", "exited"):
            self.fail_all(event.get("message") or "a worker stopped")

    def _unavailable(self) -> ApiError:
        return ApiError(503, f"cluster not ready: {self.unavailable_reason}",
                        kind="server_error", code="cluster_not_ready")

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Delta | Done]:
        """Events of one generation; closing the iterator early cancels it on every rank."""
        if self.conductor is None:
            raise self._unavailable()
        if self._waiting >= MAX_WAITING:
            raise ApiError(429, "too many queued requests; retry later", kind="server_error",
                           code="queue_full")
        self._waiting += 1
        try:
            await self._slot.acquire()
        finally:
            self._waiting -= 1
        request_id = f"{request.id}-{next(self._ids)}"
        pending = _Pending()
        finished = False
        try:
            if self.conductor is None:
                raise self._unavailable()
            self._pending[request_id] = pending
            message = request.model_copy(update={"id": request_id}).model_dump(mode="json")
            if not self.conductor.send({"type": "generate", "request": message}):
                raise self._unavailable()
            while True:
                event = await pending.events.get()
                if isinstance(event, ApiError):
                    raise event
                yield event
                if isinstance(event, Done):
                    finished = True
                    self.served += 1
                    return
        finally:
            self._pending.pop(request_id, None)
            if not finished and self.conductor is not None:
                self.conductor.send({"type": "cancel", "id": request_id})
            self._slot.release()
