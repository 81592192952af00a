"""A node's long-lived worker: one rank of a cluster epoch, serving requests until replaced.

    python -m exo_tp.runtime.serve_worker ASSIGNMENT.json DAEMON_CHANNEL
    (EXO_TP_RANK, EXO_TP_SECRET and, in a stage of several ranks, MLX_RANK / MLX_HOSTFILE)

Every rank reports its progress (joining, loading, ready, error) to its own daemon; its ready
message carries the links of its stage's group, timed right after the group formed. The last
stage's first rank is the conductor: it joins the leader's request channel, hands each request
to the other ranks of its stage over plain TCP, drives generation (mlx-lm's loop) and streams
events back. Other ranks of that stage sleep in recv() between requests (never spinning in a
collective); ranks of earlier pipeline stages serve hop frames.
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
from exo_tp.node.conductor_link import hello_message
from exo_tp.node.security import sign
from exo_tp.profile.collective_speed import group_links
from exo_tp.runtime.generation import StopSignal, generate
from exo_tp.runtime.job import RANK_ENV, SECRET_ENV, Assignment
from exo_tp.runtime.lifecycle import die_with_parent
from exo_tp.runtime.messages import Delta, GenerateRequest, TokenLogprob
from exo_tp.runtime.pipeline import stage_driver
from exo_tp.runtime.ring import init_group
from exo_tp.runtime.sampling import token_logprob
from exo_tp.runtime.stop_strings import StopMatcher
from exo_tp.runtime.wire import Line, connect, listen
from exo_tp.runtime.worker import DTYPES
from exo_tp.shard.apply import load_shard

log = logging.getLogger("exo_tp.serve_worker")
PEER_TIMEOUT = 120.0


class Conductor:
    """Requests in from the leader, out to the stage's other ranks, events back."""

    def __init__(self, leader: Line, followers: list[Line], model: Any, tokenizer: Any,
                 group: mx.distributed.Group):
        self.leader, self.followers = leader, followers
        self.model, self.tokenizer, self.group = model, tokenizer, group
        self.requests: queue.Queue[GenerateRequest] = queue.Queue()
        self.current_id: str | None = None
        self.stop = StopSignal()
        self._lock = threading.Lock()

    def read_leader(self) -> None:
        """Request channel reader (thread): queue requests, raise cancel flags."""
        while (message := self.leader.recv()) is not None:
            if message["type"] == "generate":
                self.requests.put(GenerateRequest.model_validate(message["request"]))
            elif message["type"] == "cancel":
                with self._lock:
                    if message["id"] == self.current_id:
                        self.stop.set()
        os._exit(0)  # the leader dropped us: this epoch is over

    def serve(self) -> None:
        threading.Thread(target=self.read_leader, daemon=True).start()
        while True:
            request = self.requests.get()  # blocks: idle ranks sleep
            with self._lock:
                self.current_id, self.stop = request.id, StopSignal()
            for follower in self.followers:
                follower.send(request.model_dump(mode="json"))
            self._run(request)

    def _emit(self, request: GenerateRequest, text: str, tokens: tuple[int, ...] = (),
              logprobs: tuple[TokenLogprob, ...] = ()) -> None:
        if text or tokens:
            delta = Delta(id=request.id, text=text, tokens=tokens, logprobs=logprobs)
            self.leader.send({"type": "delta", **delta.model_dump(mode="json")})

    def _run(self, request: GenerateRequest) -> None:
        matcher = StopMatcher(request.stop)
        finish, produced, started = "length", 0, time.perf_counter()
        params = request.sampling
        for response in generate(self.model, self.tokenizer, list(request.tokens),
                                 params, self.group, self.stop):
            if matcher.stopped:
                continue  # the ranks finish the token or two in flight; none is reported
            produced = response.generation_tokens
            scored = (token_logprob(response.logprobs, response.token, params.top_logprobs),) \
                if params.logprobs else ()
            self._emit(request, matcher.feed(response.text), (response.token,), scored)
            if matcher.stopped and not self.stop.is_set():
                self.stop.set()  # every rank of the stage ends within a token or two
            if response.finish_reason:
                finish = response.finish_reason
        if matcher.stopped:
            finish = "stop"
        elif self.stop.is_set():
            finish = "cancelled"
        else:
            self._emit(request, matcher.flush())
        self.leader.send({
            "type": "done", "id": request.id, "finish_reason": finish,
            "stop_string": matcher.matched,
            "usage": {"prompt_tokens": len(request.tokens), "completion_tokens": produced},
            "seconds": time.perf_counter() - started,
        })


def follow(conductor: Line, model: Any, tokenizer: Any, group: mx.distributed.Group) -> None:
    """Other ranks of the last stage: run each request; the conductor decides every token."""
    while (message := conductor.recv()) is not None:
        request = GenerateRequest.model_validate(message)
        for _ in generate(model, tokenizer, list(request.tokens), request.sampling, group):
            pass


def _accept(address: str, count: int) -> list[Line]:
    server = listen(address)
    server.settimeout(PEER_TIMEOUT)
    try:
        return [Line(server.accept()[0]) for _ in range(count)]
    except TimeoutError:
        raise RuntimeError(f"only some ranks reached the conductor within {PEER_TIMEOUT:.0f}s") \
            from None
    finally:
        server.close()


def _exit_when_closed(line: Line) -> None:
    """Exit when the daemon closes its channel (it replaced or stopped this worker)."""
    while line.recv() is not None:
        pass
    os._exit(0)


def _join_leader(assignment: Assignment) -> Line:
    leader = connect(assignment.requests_at, PEER_TIMEOUT)
    secret = os.environ.get(SECRET_ENV, "")
    leader.send({"type": "hello", "epoch": assignment.epoch,
                 "sig": sign(secret, hello_message(assignment.epoch))})
    return leader


def run(assignment: Assignment, daemon: Line) -> None:
    plan, rank = assignment.plan, assignment.rank
    index, local = plan.locate(rank)
    stage, stages = plan.stages[index], plan.stages
    first, last = index == 0, index == len(stages) - 1
    daemon.send({"type": "joining", "epoch": assignment.epoch})
    group = init_group()
    # Every rank of the stage times the same collectives, in step, before loading.
    names = [assignment.nodes[r] if assignment.nodes else str(r) for r in stage.ranks]
    ready = {"type": "ready", "epoch": assignment.epoch, "rank": rank,
             "links": [link.model_dump(mode="json") for link in group_links(group, names)]}
    daemon.send({"type": "loading", "epoch": assignment.epoch})
    model_dir = Path(resolve_model(assignment.model))
    model = load_shard(model_dir, stage.tp, local, group, DTYPES[assignment.dtype],
                       stage.layers, first, last)
    threading.Thread(target=_exit_when_closed, args=(daemon,), daemon=True).start()
    driver = stage_driver(model, plan, rank, assignment.hops, PEER_TIMEOUT,
                          before_serving=lambda: daemon.send(ready))
    if driver is None:  # an earlier stage: served until the last stage closed its link
        return
    tokenizer = load_tokenizer(model_dir)
    if local == 0:
        followers = _accept(assignment.conductor, stage.size - 1)
        leader = _join_leader(assignment)
    else:
        conductor = connect(assignment.conductor, PEER_TIMEOUT)
    daemon.send(ready)
    if local == 0:
        Conductor(leader, followers, driver, tokenizer, group).serve()
    else:
        follow(conductor, driver, tokenizer, group)


def main() -> None:
    die_with_parent()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s worker rank {os.environ.get(RANK_ENV, '0')} "
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
    os._exit(0)


if __name__ == "__main__":
    main()
