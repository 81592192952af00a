"""The one framing of every link between exo-tp processes.

The standard library's `multiprocessing.connection` frames messages (length-prefixed) and
authenticates both ends with an HMAC challenge-response over a shared key (the cluster secret,
or a per-job key for `exo-tp launch`), so no hand-made socket protocol is needed. Messages are
pydantic models sent as JSON (never pickle: `Connection.recv` would unpickle whatever a peer
sends); a pipeline hop follows its typed header with the activation's raw bytes.

Sockets block on purpose: a rank waiting for work sleeps in a read, it never spins in a
collective. Listeners authenticate each new connection in its own thread under a time limit, so
a silent or hostile client cannot hold up the peers that are expected.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Generic, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0
MAX_PENDING_HANDSHAKES = 16
# Dead peers on a LAN (a machine switched off) are noticed within about half a minute.
KEEPALIVE = {"TCP_KEEPIDLE": 10, "TCP_KEEPINTVL": 5, "TCP_KEEPCNT": 3}

M = TypeVar("M")


class ChannelError(ConnectionError):
    """A peer sent something that is not a message of this link (a bug or another version)."""


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def _timeouts(sock: socket.socket, seconds: float) -> None:
    """Kernel-level read/write timeouts (0: none); they stay with the descriptor when a
    `Connection` takes it over, unlike Python's own socket timeouts."""
    whole = int(seconds)
    value = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in KEEPALIVE.items():
        option = getattr(socket, name, None)
        if option is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
    if sys.platform == "darwin":  # macOS names the idle time TCP_KEEPALIVE
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, 0x10, KEEPALIVE["TCP_KEEPIDLE"])


def _authenticated(sock: socket.socket, authkey: bytes, server: bool) -> Connection:
    """Take over ``sock`` as a Connection once both ends proved they hold ``authkey``."""
    _tune(sock)
    _timeouts(sock, HANDSHAKE_TIMEOUT)
    conn = Connection(sock.detach())
    try:
        if server:
            deliver_challenge(conn, authkey)
            answer_challenge(conn, authkey)
        else:
            answer_challenge(conn, authkey)
            deliver_challenge(conn, authkey)
        with socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM) as view:
            _timeouts(view, 0)  # the handshake is over: reads may wait for work forever
    except BaseException:
        conn.close()
        raise
    return conn


class Channel(Generic[M]):
    """One authenticated link: typed messages out (any model), ``incoming`` models in."""

    def __init__(self, conn: Connection, incoming: TypeAdapter[M], peer: str = ""):
        self._conn = conn
        self._incoming = incoming
        self._send_lock = threading.Lock()
        self.peer = peer

    def send(self, message: BaseModel, raw: bytes | memoryview | None = None) -> None:
        """Send ``message`` (then ``raw`` as its own frame); thread-safe."""
        data = message.model_dump_json().encode()
        with self._send_lock:
            self._conn.send_bytes(data)
            if raw is not None:
                self._conn.send_bytes(raw)

    def recv(self) -> M | None:
        """The next message, or None once the peer closed the link (or it broke)."""
        data = self.recv_raw()
        if data is None:
            return None
        try:
            return self._incoming.validate_json(data)
        except ValidationError as error:
            raise ChannelError(
                f"unexpected message from {self.peer or 'peer'}: {error.errors()[0]['msg']}"
            ) from None

    def recv_raw(self) -> bytes | None:
        try:
            return self._conn.recv_bytes()
        except (EOFError, OSError, TypeError):  # TypeError: closed by another thread mid-read
            return None

    def poll(self, timeout: float) -> bool:
        try:
            return self._conn.poll(timeout)
        except (EOFError, OSError):
            return True  # a read would now return None at once

    def close(self) -> None:
        """Close the link; the peer sees it at once, even while a thread here is blocked
        reading it (closing the descriptor alone would wait for that read to return)."""
        with contextlib.suppress(OSError):
            if not self._conn.closed:
                with socket.fromfd(self._conn.fileno(), socket.AF_INET, socket.SOCK_STREAM) as view:
                    view.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._conn.close()

    @property
    def closed(self) -> bool:
        return self._conn.closed


def connect(address: str, authkey: bytes, incoming: TypeAdapter[M], timeout: float) -> Channel[M]:
    """Connect to ``address`` ("host:port"), retrying until ``timeout`` while nobody listens."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            patience = min(5.0, max(0.05, deadline - time.monotonic()))
            sock = socket.create_connection(split_address(address), timeout=patience)
            sock.settimeout(None)
            return Channel(_authenticated(sock, authkey, server=False), incoming, address)
        except AuthenticationError:
            raise ConnectionRefusedError(
                f"{address} refused our key (another cluster secret?)"
            ) from None
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


class Listener(Generic[M]):
    """Accepts authenticated channels on ``address`` ("host:port"; port 0: any) and hands each
    to ``on_channel`` from its own thread; strangers are dropped and logged."""

    def __init__(
        self,
        address: str,
        authkey: bytes,
        incoming: TypeAdapter[M],
        on_channel: Callable[[Channel[M]], None],
        name: str = "listener",
    ):
        self._authkey, self._incoming, self._on_channel = authkey, incoming, on_channel
        self._name = name
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(split_address(address))
        self._sock.listen(64)
        self._pending = threading.Semaphore(MAX_PENDING_HANDSHAKES)
        self._closed = False
        self.port: int = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name=name, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, peer = self._sock.accept()
            except OSError:
                return  # closed
            if not self._pending.acquire(blocking=False):
                sock.close()  # too many half-open connections: drop, the real ones retry
                continue
            threading.Thread(
                target=self._handshake, args=(sock, f"{peer[0]}:{peer[1]}"), daemon=True
            ).start()

    def _handshake(self, sock: socket.socket, peer: str) -> None:
        try:
            conn = _authenticated(sock, self._authkey, server=True)
        except (AuthenticationError, OSError, EOFError) as error:
            log.warning(
                "%s: refused a connection from %s: %s",
                self._name,
                peer,
                error or type(error).__name__,
            )
            with contextlib.suppress(OSError):
                sock.close()
            return
        finally:
            self._pending.release()
        self._on_channel(Channel(conn, self._incoming, peer))

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()


def accept_count(
    address: str, authkey: bytes, incoming: TypeAdapter[M], count: int, timeout: float, name: str
) -> list[Channel[M]]:
    """Listen on ``address`` until ``count`` peers connected (or fail after ``timeout``)."""
    arrived: list[Channel[M]] = []
    done = threading.Condition()

    def on_channel(channel: Channel[M]) -> None:
        with done:
            arrived.append(channel)
            done.notify_all()

    listener = Listener(address, authkey, incoming, on_channel, name)
    try:
        with done:
            if not done.wait_for(lambda: len(arrived) >= count, timeout):
                raise TimeoutError(
                    f"{name}: only {len(arrived)} of {count} peers connected within {timeout:.0f}s"
                )
        return arrived[:count]
    finally:
        listener.close()
