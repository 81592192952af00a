"""A node's long-lived worker: one rank of a cluster epoch, serving requests until told to stop.

    python -m exo_tp.runtime.serve_worker ASSIGNMENT.json DAEMON_CHANNEL
    (MLX_RANK / MLX_HOSTFILE in the environment)

Rank 0 ("conductor") takes requests from its daemon over the channel, hands each to the other
ranks over plain TCP, and streams events back. Other ranks sleep in recv() between requests (no
spinning in a collective). Every rank runs the same mlx-lm generation loop; rank 0 samples.
Events to the daemon: joining, loading, ready, delta, done, error.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.utils import load_tokenizer

from exo_tp.models.registry import resolve_model
from exo_tp.runtime.generation import StopSignal, generate
from exo_tp.runtime.job import Assignment, GenerateRequest
from exo_tp.runtime.lifecycle import die_with_parent
from exo_tp.runtime.ring import init_group
from exo_tp.runtime.stop_strings import StopMatcher
from exo_tp.runtime.wire import Line, connect, listen
from exo_tp.runtime.worker import DTYPES
from exo_tp.shard.apply import load_shard

log = logging.getLogger("exo_tp.serve_worker")
PEER_TIMEOUT = 120.0


class Conductor:
    """Rank 0: requests in from the daemon, out to the other ranks, events back."""

    def __init__(self, daemon: Line, followers: list[Line], model: Any, tokenizer: Any,
                 group: mx.distributed.Group):
        self.daemon, self.followers = daemon, followers
        self.model, self.tokenizer, self.group = model, tokenizer, group
        self.requests: queue.Queue[GenerateRequest] = queue.Queue()
        self.current_id: str | None = None
        self.stop = StopSignal()
        self._lock = threading.Lock()

    def read_daemon(self) -> None:
        """Daemon channel reader (thread): queue requests, raise cancel flags."""
        while (message := self.daemon.recv()) is not None:
            if message["type"] == "generate":
                self.requests.put(GenerateRequest.model_validate(message["request"]))
            elif message["type"] == "cancel":
                with self._lock:
                    if message["id"] == self.current_id:
                        self.stop.set()
        os._exit(0)  # the daemon is gone: so is this cluster epoch

    def serve(self) -> None:
        threading.Thread(target=self.read_daemon, daemon=True).start()
        while True:
            request = self.requests.get()  # blocks: idle ranks sleep
            with self._lock:
                self.current_id, self.stop = request.id, StopSignal()
            for follower in self.followers:
                follower.send(request.model_dump(mode="json"))
            self._run(request)

    def _run(self, request: GenerateRequest) -> None:
        matcher = StopMatcher(request.stop)
        finish, produced, started = "length", 0, time.perf_counter()
        for response in generate(self.model, self.tokenizer, list(request.tokens),
                                 request.sampling, self.group, self.stop):
            produced = response.generation_tokens
            text = matcher.feed(response.text)
            if text:
                self.daemon.send({"type": "delta", "id": request.id, "text": text})
            if matcher.stopped and not self.stop.is_set():
                self.stop.set()  # every rank ends within a token or two
            if response.finish_reason:
                finish = response.finish_reason
        if matcher.stopped:
            finish = "stop"
        elif self.stop.is_set():
            finish = "cancelled"
        else:
            tail = matcher.flush()
            if tail:
                self.daemon.send({"type": "delta", "id": request.id, "text": tail})
        elapsed = time.perf_counter() - started
        self.daemon.send({
            "type": "done", "id": request.id, "finish_reason": finish,
            "usage": {"prompt_tokens": len(request.tokens), "completion_tokens": produced},
            "seconds": elapsed,
        })


def follow(conductor: Line, model: Any, tokenizer: Any, group: mx.distributed.Group) -> None:
    """Ranks > 0: run each request rank 0 hands out; rank 0 decides every token."""
    while (message := conductor.recv()) is not None:
        request = GenerateRequest.model_validate(message)
        for _ in generate(model, tokenizer, list(request.tokens), request.sampling, group):
            pass


def _accept_followers(address: str, count: int) -> list[Line]:
    server = listen(address)
    server.settimeout(PEER_TIMEOUT)
    try:
        return [Line(server.accept()[0]) for _ in range(count)]
    except TimeoutError:
        raise RuntimeError(f"only some ranks reached rank 0 within {PEER_TIMEOUT:.0f}s") from None
    finally:
        server.close()


def _watch_daemon(daemon: Line) -> None:
    """Ranks > 0: exit when the daemon closes the channel (it replaced or stopped us)."""
    while daemon.recv() is not None:
        pass
    os._exit(0)


def run(assignment: Assignment, daemon: Line) -> None:
    daemon.send({"type": "joining", "epoch": assignment.epoch})
    group = init_group()
    rank = group.rank()
    daemon.send({"type": "loading", "epoch": assignment.epoch})
    model_dir = resolve_model(assignment.model)
    model = load_shard(Path(model_dir), assignment.plan, rank, group, DTYPES[assignment.dtype])
    tokenizer = load_tokenizer(Path(model_dir))
    if rank == 0:
        followers = _accept_followers(assignment.conductor, group.size() - 1)
    else:
        conductor = connect(assignment.conductor, PEER_TIMEOUT)
        threading.Thread(target=_watch_daemon, args=(daemon,), daemon=True).start()
    daemon.send({"type": "ready", "epoch": assignment.epoch, "rank": rank,
                 "memory": mx.get_active_memory()})
    if rank == 0:
        Conductor(daemon, followers, model, tokenizer, group).serve()
    else:
        follow(conductor, model, tokenizer, group)


def main() -> None:
    die_with_parent()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s worker rank {os.environ.get('MLX_RANK', '0')} "
                               "%(levelname)s %(message)s")
    assignment = Assignment.model_validate_json(Path(sys.argv[1]).read_text())
    daemon = connect(sys.argv[2], timeout=30)
    try:
        run(assignment, daemon)
    except Exception as error:  # report, then die: a broken ring cannot be reused
        log.exception("worker failed")
        try:
            daemon.send({"type": "error", "message": f"{type(error).__name__}: {error}"})
        finally:
            os._exit(1)


if __name__ == "__main__":
    main()
