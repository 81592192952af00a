"""Line-delimited JSON over TCP: the daemon <-> worker channel and rank 0 -> other ranks.

Blocking sockets on purpose: a rank waiting for work must sleep in recv(), not spin in a
collective.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from typing import Any


class Line:
    """A connected socket carrying one JSON object per line (thread-safe sends)."""

    def __init__(self, sock: socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._reader = sock.makefile("rb")
        self._lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        with self._lock:
            self.sock.sendall(data)

    def recv(self) -> dict[str, Any] | None:
        """The next message, or None when the peer closed the connection."""
        raw = self._reader.readline()
        return json.loads(raw) if raw else None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def connect(address: str, timeout: float) -> Line:
    """Connect, retrying until ``timeout`` (the listener may not be up yet)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection(split_address(address), timeout=5)
            sock.settimeout(None)
            return Line(sock)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def listen(address: str) -> socket.socket:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(split_address(address))
    server.listen()
    return server
