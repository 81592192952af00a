"""Private port ranges for ring jobs.

Ring sockets use SO_REUSEPORT, so two jobs listening on one port silently mix their traffic.
Each job therefore takes ports probed free *without* SO_REUSEPORT: a port another ring job
listens on fails the probe.

The ports come from below the kernel's ephemeral range, at random. A job binds its ports
seconds after the probe (its ranks import and load first), and in between the kernel may hand a
port of its ephemeral range, just probed free, to any connecting socket on the machine as its
local port: on a busy machine a rank then failed with "Address already in use" (one launch in
the suite's ~800 tests, run beside another worker's HTTP clients). Below that range only
another job choosing the same port at random can take it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 10_000  # below: the registered ports of common services
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
IANA_EPHEMERAL_LOW = 49_152  # macOS's and the IANA's first ephemeral port
# Not the random module's shared generator: a test (or a program) that seeds it would make two
# processes draw the same ports.
_DRAW = random.SystemRandom()


def ephemeral_low() -> int:
    """The first port the kernel hands to connecting sockets."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return IANA_EPHEMERAL_LOW


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports free on ``host`` right now, from below the ephemeral range (or
    any the kernel hands out, where that range starts too low to leave room, or after as many
    draws as 20 per port found taken)."""
    top = ephemeral_low()
    draws = 20 * count if top - LOWEST >= 1_000 else 0
    sockets: list[socket.socket] = []
    try:
        for _ in range(draws):
            if len(sockets) == count:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, _DRAW.randrange(LOWEST, top)))
            except OSError:  # taken
                s.close()
                continue
            sockets.append(s)
        while len(sockets) < count:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(s)
            s.bind((host, 0))
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
