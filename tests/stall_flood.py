"""Hold COUNT stalled connections against 127.0.0.1:PORT for SECONDS, from many loopback
addresses (PER_ADDRESS each); half never finish their headers, half stall in their body. Each
one the node closes is opened again (one it refused, after TIMEOUT). Prints one JSON line:
how connections ended ("closed", HTTP statuses, "connect failed", "reset"), how many stalls
were sent, and how long admitted connections stayed open from the client's side (median, p99,
longest, seconds: the node's timeout plus the time a connection waited in the kernel's accept
queue before the node took it).

A separate process with no mlx_lm import: importing mlx_lm caps a process's open files at
4096, and this needs COUNT of them.

    python tests/stall_flood.py PORT COUNT SECONDS TIMEOUT PER_ADDRESS
"""

from __future__ import annotations

import json
import resource
import selectors
import socket
import sys
import time
from collections import Counter

STALLS = (
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ",  # headers never finished
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: 1000\r\n\r\n{",  # a body that stalls
)


def main() -> int:
    port, count = int(sys.argv[1]), int(sys.argv[2])
    seconds, timeout, per_address = float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = count + 64
    if hard != resource.RLIM_INFINITY and hard < wanted:
        print(json.dumps({"error": f"needs {wanted} open files; the hard limit is {hard}"}))
        return 1
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    sources = [f"127.0.0.{i}" for i in range(2, 2 + -(-count // per_address))]
    selector = selectors.DefaultSelector()
    outcomes: Counter[str] = Counter()
    lifetimes: list[float] = []

    def open_one(i: int) -> None:
        s = socket.socket()
        s.setblocking(False)
        s.bind((sources[i % len(sources)], 0))
        s.connect_ex(("127.0.0.1", port))
        selector.register(s, selectors.EVENT_WRITE, (i, time.monotonic(), "connecting"))

    def drop(s: socket.socket) -> None:
        selector.unregister(s)
        s.close()

    for i in range(count):
        open_one(i)
    later: list[tuple[float, int]] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        now = time.monotonic()
        for key, _ in selector.select(0.1):
            s: socket.socket = key.fileobj  # type: ignore[assignment]
            i, since, state = key.data
            if state == "connecting":
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    outcomes["connect failed"] += 1
                    drop(s)
                    later.append((now + timeout, i))
                    continue
                try:
                    s.send(STALLS[i % 2])
                except OSError:
                    outcomes["reset"] += 1
                    drop(s)
                    later.append((now + timeout, i))
                    continue
                outcomes["stalled"] += 1
                selector.modify(s, selectors.EVENT_READ, (i, now, "stalled"))
                continue
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            now = time.monotonic()  # per event: one pass over thousands takes a while
            drop(s)
            status = data[9:12].decode() if data.startswith(b"HTTP/1.") else "closed"
            outcomes[status] += 1
            if status in ("429", "503"):
                later.append((now + timeout, i))
            else:
                lifetimes.append(now - since)
                later.append((now, i))
        due = [i for at, i in later if at <= now]
        later = [(at, i) for at, i in later if at > now]
        for i in due:
            open_one(i)
    now = time.monotonic()
    for key in list(selector.get_map().values()):
        if key.data[2] == "stalled":
            lifetimes.append(now - key.data[1])
        drop(key.fileobj)  # type: ignore[arg-type]
    lifetimes.sort()
    spread = {
        "median": lifetimes[len(lifetimes) // 2] if lifetimes else 0.0,
        "p99": lifetimes[int(0.99 * (len(lifetimes) - 1))] if lifetimes else 0.0,
        "longest": lifetimes[-1] if lifetimes else 0.0,
    }
    print(json.dumps({**outcomes, **{k: round(v, 2) for k, v in spread.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
