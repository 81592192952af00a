"""Before measuring links, find which peers are running the bench (bounded wait).

Every node listens on its rendezvous port and knocks on every other node's. One exchange in either
direction tells both sides that the pair is up (the listener records the peer before it answers),
so a node stops waiting once it has met everyone. Peers not met within the timeout are down: the
link schedule then skips them at once instead of waiting for them round after round.
"""

from __future__ import annotations

import socket
import threading
import time

from exo_tp.errors import ExoTpError
from exo_tp.profile.peers import Peers

KNOCK_TIMEOUT = 1.0
RETRY_SECONDS = 0.2
_MAGIC = "exo-tp-bench"


def _hello(peers: Peers) -> bytes:
    return f"{_MAGIC} {peers.rank} {peers.fingerprint()}\n".encode()


def _parse(line: bytes, peers: Peers) -> tuple[int, str | None]:
    """(peer rank, error) from a hello line; rank -1 if it is not one."""
    parts = line.decode(errors="replace").split()
    if len(parts) != 3 or parts[0] != _MAGIC or not parts[1].isdigit():
        return -1, None
    rank = int(parts[1])
    if rank >= peers.size or rank == peers.rank:
        return -1, None
    if parts[2] != peers.fingerprint():
        return rank, "peer was started with different --peers or --port-base"
    return rank, None


class _Listener(threading.Thread):
    def __init__(self, peers: Peers, met: dict[int, str | None]) -> None:
        super().__init__(daemon=True)
        self.peers, self.met, self.stop = peers, met, threading.Event()
        address = (peers.addresses[peers.rank], peers.hello_port(peers.rank))
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind(address)
        except OSError as error:
            self.sock.close()
            raise ExoTpError(f"cannot listen on {address[0]}:{address[1]} for peers: "
                             f"{error.strerror or error}") from None
        self.sock.listen(16)
        self.sock.settimeout(RETRY_SECONDS)

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                try:
                    conn.settimeout(KNOCK_TIMEOUT)
                    rank, error = _parse(conn.makefile("rb").readline(), self.peers)
                    if rank >= 0:
                        self.met[rank] = error  # recorded before answering: see module doc
                        conn.sendall(_hello(self.peers))
                except OSError:
                    continue

    def close(self) -> None:
        self.stop.set()
        self.join()
        self.sock.close()


def _knock(peers: Peers, rank: int, patience: float) -> tuple[bool, str | None]:
    """(answered, error): one attempt to greet ``rank``."""
    address = (peers.addresses[rank], peers.hello_port(rank))
    try:
        with socket.create_connection(address, timeout=patience) as conn:
            conn.sendall(_hello(peers))
            answer, error = _parse(conn.makefile("rb").readline(), peers)
    except OSError as error:
        return False, f"{address[0]}:{address[1]}: {error.strerror or error}"
    if answer != rank:
        return False, f"{address[0]}:{address[1]} is not an exo-tp bench of rank {rank}"
    return True, error


def meet_peers(peers: Peers, timeout: float) -> dict[int, str | None]:
    """For every other rank: None if it is up, else why not (after at most ``timeout`` s)."""
    met: dict[int, str | None] = {}
    why: dict[int, str] = {}
    listener = _Listener(peers, met)
    listener.start()
    deadline = time.monotonic() + timeout
    others = [r for r in range(peers.size) if r != peers.rank]
    try:
        while time.monotonic() < deadline:
            for rank in others:
                if rank not in met:
                    patience = min(KNOCK_TIMEOUT, max(0.05, deadline - time.monotonic()))
                    answered, error = _knock(peers, rank, patience)
                    if answered:
                        met[rank] = error
                    else:
                        why[rank] = error or "no answer"
            if all(r in met for r in others):
                break
            time.sleep(RETRY_SECONDS)
    finally:
        listener.close()
    return {r: met[r] if r in met else f"unreachable within {timeout:g}s ({why.get(r)})"
            for r in others}
