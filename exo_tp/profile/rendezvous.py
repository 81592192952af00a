"""Before measuring links, find which peers are running the bench (bounded wait).

Every node listens on its rendezvous port and knocks on every other node's. One exchange of
`BenchHello`s in either direction tells both sides that the pair is up (the listener records the
peer before it answers), so a node stops waiting once it has met everyone. Peers not met within
the timeout are down: the link schedule then skips them at once instead of waiting for them round
after round. Links are the runtime's channels (`exo_tp.transport.channel`).
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import TypeAdapter

from exo_tp.errors import ExoTpError
from exo_tp.frozen import Frozen
from exo_tp.profile.peers import Peers
from exo_tp.transport.channel import Channel, Listener, connect

KNOCK_TIMEOUT = 1.0
RETRY_SECONDS = 0.2
# Benches share no secret: the key only tells an exo-tp bench from anything else on the port.
BENCH_KEY = b"exo-tp-bench"


class BenchHello(Frozen):
    kind: Literal["bench_hello"] = "bench_hello"
    rank: int
    fingerprint: str  # equal on benches started with the same peers and ports


HELLO: TypeAdapter[BenchHello] = TypeAdapter(BenchHello)


def _hello(peers: Peers) -> BenchHello:
    return BenchHello(rank=peers.rank, fingerprint=peers.fingerprint())


def _check(hello: BenchHello | None, peers: Peers) -> tuple[int, str | None]:
    """(peer rank, error) from a hello; rank -1 if it is not one of ours."""
    if hello is None or not 0 <= hello.rank < peers.size or hello.rank == peers.rank:
        return -1, None
    if hello.fingerprint != peers.fingerprint():
        return hello.rank, "peer was started with different --peers or --port-base"
    return hello.rank, None


def _listen(peers: Peers, met: dict[int, str | None]) -> Listener[BenchHello]:
    def on_channel(channel: Channel[BenchHello]) -> None:
        try:
            if channel.poll(KNOCK_TIMEOUT):
                rank, error = _check(channel.recv(), peers)
                if rank >= 0:
                    met[rank] = error  # recorded before answering: see module doc
                    channel.send(_hello(peers))
        except (OSError, ValueError):
            pass
        finally:
            channel.close()

    address = f"{peers.addresses[peers.rank]}:{peers.hello_port(peers.rank)}"
    try:
        return Listener(address, BENCH_KEY, HELLO, on_channel, "bench rendezvous")
    except OSError as error:
        raise ExoTpError(
            f"cannot listen on {address} for peers: {error.strerror or error}"
        ) from None


def _knock(peers: Peers, rank: int, patience: float) -> tuple[bool, str | None]:
    """(answered, error): one attempt to greet ``rank``."""
    address = f"{peers.addresses[rank]}:{peers.hello_port(rank)}"
    try:
        channel = connect(address, BENCH_KEY, HELLO, patience)
        try:
            channel.send(_hello(peers))
            answer, error = _check(channel.recv() if channel.poll(patience) else None, peers)
        finally:
            channel.close()
    except (OSError, ValueError) as error:
        return False, f"{address}: {getattr(error, 'strerror', None) or error}"
    if answer != rank:
        return False, f"{address} is not an exo-tp bench of rank {rank}"
    return True, error


def meet_peers(peers: Peers, timeout: float) -> dict[int, str | None]:
    """For every other rank: None if it is up, else why not (after at most ``timeout`` s)."""
    met: dict[int, str | None] = {}
    why: dict[int, str] = {}
    listener = _listen(peers, met)
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
    return {
        r: met[r] if r in met else f"unreachable within {timeout:g}s ({why.get(r)})" for r in others
    }
