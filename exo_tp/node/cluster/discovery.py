"""mDNS discovery with zeroconf: advertise this node, browse for peers of the same cluster."""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
from collections.abc import Callable

from zeroconf import DNSQuestionType, IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from exo_tp.wire.announcement import SERVICE_TYPE, Announcement
from exo_tp.wire.ids import NodeId

log = logging.getLogger(__name__)
RESOLVE_ATTEMPTS = 8


class Discovery:
    """Calls ``on_peer(announcement)`` for verified peers and ``on_gone(node_id)``."""

    def __init__(
        self,
        me: Announcement,
        secret: str,
        interface: str,
        on_peer: Callable[[Announcement], None],
        on_gone: Callable[[NodeId], None],
    ):
        self.me, self.secret, self.interface = me, secret, interface
        self.on_peer, self.on_gone = on_peer, on_gone
        self._zc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._names: dict[str, NodeId] = {}  # service name -> node id
        self._strangers: set[tuple[str, str]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._token = secrets.token_hex(4)

    def _info(self) -> AsyncServiceInfo:
        # mDNS instance names are global on a network: several clusters (or restarts) may reuse
        # a node id, so the name carries a per-start token; the node id is in the signed TXT.
        return AsyncServiceInfo(
            SERVICE_TYPE,
            f"{self.me.node_id}-{self._token}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton(self.me.host)],
            port=self.me.api_port,
            properties=self.me.to_txt(self.secret),
        )

    async def start(self) -> None:
        interfaces = [self.interface] if self.interface not in ("", "0.0.0.0") else None
        self._zc = AsyncZeroconf(interfaces=interfaces or "all", ip_version=IPVersion.V4Only)
        await self._zc.async_register_service(self._info(), allow_name_change=True)
        self._browser = AsyncServiceBrowser(
            self._zc.zeroconf, SERVICE_TYPE, handlers=[self._on_change]
        )

    async def stop(self) -> None:
        for task in self._tasks:  # resolutions still retrying
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._browser is not None:
            await self._browser.async_cancel()
        if self._zc is not None:
            await self._zc.async_unregister_all_services()
            await self._zc.async_close()

    def _on_change(
        self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        if state_change is ServiceStateChange.Removed:
            node_id = self._names.pop(name, None)
            if node_id:
                self.on_gone(node_id)
            return
        task = asyncio.ensure_future(self._resolve(zeroconf, name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resolve(self, zeroconf: Zeroconf, name: str) -> None:
        # Multicast answers (QM): several nodes on one host share port 5353 with SO_REUSEPORT,
        # so a unicast answer may reach another process. Retry: a lost answer must not lose
        # the peer until its next announcement.
        for attempt in range(RESOLVE_ATTEMPTS):
            info = AsyncServiceInfo(SERVICE_TYPE, name)
            if (
                await info.async_request(zeroconf, 3000, question_type=DNSQuestionType.QM)
                and info.properties
            ):
                break
            await asyncio.sleep(min(8.0, 0.5 * 2**attempt))
        else:
            log.warning("could not resolve %s after %d attempts", name, RESOLVE_ATTEMPTS)
            return
        announcement, why = Announcement.from_txt(info.properties, self.secret)
        if announcement is None or announcement.cluster != self.me.cluster:
            why = why or f"cluster {announcement.cluster!r} is not ours"  # type: ignore[union-attr]
            if (name, why) not in self._strangers:  # log each stranger once, not every refresh
                self._strangers.add((name, why))
                log.warning("ignored announcement %s: %s", name, why)
            return
        if announcement.node_id == self.me.node_id:
            return
        self._names[name] = announcement.node_id
        self.on_peer(announcement)
