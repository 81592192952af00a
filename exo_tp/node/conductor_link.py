"""The leader's request channel: the conductor worker (the last stage's first rank, on
whichever node) connects here; requests go out and generation events come back.

The conductor proves it belongs to the cluster with an HMAC of the epoch under the secret.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from exo_tp.node.security import verify

log = logging.getLogger(__name__)


def hello_message(epoch: int) -> bytes:
    return f"conductor:{epoch}".encode()


class ConductorLink:
    """One connected conductor of one epoch."""

    def __init__(self, epoch: int, writer: asyncio.StreamWriter):
        self.epoch = epoch
        self._writer = writer

    def send(self, message: dict[str, Any]) -> bool:
        if self._writer.is_closing():
            return False
        self._writer.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")
        return True

    def close(self) -> None:
        self._writer.close()


class RequestChannel:
    """Accepts conductors; hands each verified one to ``on_link`` and its events to
    ``on_event``; ``on_lost(link)`` when it disconnects."""

    def __init__(self, secret: str, on_link: Callable[[ConductorLink], None],
                 on_event: Callable[[ConductorLink, dict[str, Any]], None],
                 on_lost: Callable[[ConductorLink], None]):
        self._secret = secret
        self._on_link, self._on_event, self._on_lost = on_link, on_event, on_lost
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str) -> int:
        self._server = await asyncio.start_server(self._serve, host, 0)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = json.loads(await asyncio.wait_for(reader.readline(), 10))
            epoch = int(hello["epoch"])
            if not verify(self._secret, hello_message(epoch), str(hello["sig"])):
                raise ValueError("bad signature")
        except (ValueError, KeyError, TypeError, asyncio.TimeoutError) as error:
            log.warning("refused a conductor connection: %s", error)
            writer.close()
            return
        link = ConductorLink(epoch, writer)
        self._on_link(link)
        try:
            while line := await reader.readline():
                self._on_event(link, json.loads(line))
        except (ConnectionError, json.JSONDecodeError):
            pass
        finally:
            writer.close()
            self._on_lost(link)
