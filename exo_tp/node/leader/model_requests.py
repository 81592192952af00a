"""Requests to load a model: the API asks (a request named a model the cluster does not serve
now), the leader's formation loop reads them from a typed queue and forms the next epoch with
that model.

The cluster serves one model at a time, so only the latest request counts.
"""

from __future__ import annotations

import asyncio
import logging

from exo_tp.frozen import Frozen

log = logging.getLogger(__name__)


class LoadModel(Frozen):
    """Serve this model next."""

    key: str
    name: str  # as the request named it (for the log)
    adapter_job: str | None = None  # a fine-tuning job whose adapter goes on every shard


class ModelRequests:
    def __init__(self) -> None:
        self._queue: asyncio.Queue[LoadModel] = asyncio.Queue()
        self._asked: tuple[str, str | None] | None = (
            None  # the key (and adapter) asked for (to log each change once)
        )

    def load(self, key: str, name: str, adapter_job: str | None = None) -> None:
        """Ask the leader to serve ``key`` next (it forms a new epoch once it reads this),
        with the adapter of fine-tuning job ``adapter_job`` if given."""
        if self._asked != (key, adapter_job):
            log.info("a request asks for %s: loading it", name)
        self._asked = (key, adapter_job)
        self._queue.put_nowait(LoadModel(key=key, name=name, adapter_job=adapter_job))

    def latest(self) -> LoadModel | None:
        """The newest request not read yet (the older ones are superseded), without waiting."""
        newest = None
        while not self._queue.empty():
            newest = self._queue.get_nowait()
        return newest
