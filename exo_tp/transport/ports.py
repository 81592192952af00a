"""Private port ranges for ring jobs.

Ring sockets use SO_REUSEPORT, so two jobs listening on one port silently mix their traffic.
Each job therefore takes ports the kernel has just handed out as free, probed *without*
SO_REUSEPORT: a port another ring job listens on fails the probe.
"""

from __future__ import annotations

import socket


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    sockets: list[socket.socket] = []
    try:
        while len(sockets) < count:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
