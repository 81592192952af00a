"""Pipeline hops: activations and tokens between stages over TCP (one MLX group per stage).

A frame is a JSON header line then raw bytes. bfloat16 travels as float32 (numpy has no
bfloat16; the round trip is exact) and is cast back on arrival.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from exo_tp.runtime.wire import connect, listen


@dataclass
class Frame:
    kind: str  # "tokens", "hidden", "reset"
    array: mx.array | None = None


def _send_frame(sock: socket.socket, frame: Frame) -> None:
    header: dict[str, object] = {"kind": frame.kind}
    payload = b""
    if frame.array is not None:
        dtype = frame.array.dtype
        data = np.array(frame.array.astype(mx.float32) if dtype == mx.bfloat16 else frame.array)
        header.update(shape=list(data.shape), dtype=str(data.dtype),
                      cast=str(dtype).split(".")[-1], nbytes=data.nbytes)
        payload = data.tobytes()
    sock.sendall(json.dumps(header).encode() + b"\n" + payload)


class HopIn:
    """The one incoming hop of a rank (from the previous stage's first rank)."""

    def __init__(self, sock: socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._file = sock.makefile("rb")

    def recv(self) -> Frame | None:
        line = self._file.readline()
        if not line:
            return None
        header = json.loads(line)
        if "shape" not in header:
            return Frame(header["kind"])
        data = np.frombuffer(self._file.read(header["nbytes"]), dtype=header["dtype"])
        array = mx.array(data.reshape(header["shape"]))
        return Frame(header["kind"], array.astype(getattr(mx, header["cast"])))


class HopOut:
    """A stage's first rank sending to every rank of the next stage."""

    def __init__(self, socks: list[socket.socket]):
        for sock in socks:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._socks = socks

    def send(self, frame: Frame) -> None:
        for sock in self._socks:
            _send_frame(sock, frame)


def open_hops(my_address: str, targets: list[str], expect_incoming: bool,
              timeout: float) -> tuple[HopIn | None, HopOut | None]:
    """Listen on ``my_address``, connect to ``targets``, accept the one incoming hop."""
    server = listen(my_address) if expect_incoming else None
    try:
        out = HopOut([connect(t, timeout).sock for t in targets]) if targets else None
        incoming = None
        if server is not None:
            server.settimeout(timeout)
            incoming = HopIn(server.accept()[0])
        return incoming, out
    finally:
        if server is not None:
            server.close()
