"""`exo-tp launch`: a local cluster that serves one request.

The ranks are the same rank program a node runs (`exo_tp.runtime.rank`), started by the same
supervisor (`exo_tp.process.supervisor`), each with its own MLX ring per stage on 127.0.0.1 and
private ports. This process is their supervisor and their request source: it sends the one
request, prints the text as it streams in, and stops the ranks. A rank that dies, or stalls,
ends the launch with one line naming it.
"""

from __future__ import annotations

import logging
import queue
import secrets
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from exo_tp.errors import ExoTpError
from exo_tp.frozen import Frozen
from exo_tp.plan.pipeline import PipelinePlan
from exo_tp.process.events import Exited, Failed, ProcessEvent
from exo_tp.process.supervisor import Child, Supervisor
from exo_tp.runtime.rank_process import rank_job, rank_memory
from exo_tp.transport.channel import Channel, Listener
from exo_tp.transport.ports import free_ports
from exo_tp.wire.assignment import Assignment, DType, ServingOptions
from exo_tp.wire.runtime import (
    CONDUCTOR_EVENTS,
    RANK_EVENTS,
    Delta,
    Done,
    FinishReason,
    Generate,
    GenerateRequest,
    Hello,
    RankMemory,
    RequestFailed,
)

log = logging.getLogger(__name__)

ADDRESS = "127.0.0.1"


class LaunchReport(Frozen):
    """What a launch returns, and `exo-tp launch --report-out` writes."""

    tokens: tuple[int, ...]  # the generated token ids
    text: str
    prompt_tokens: int
    generation_tps: float  # decode tokens/s, after the first token
    prompt_tps: float  # prompt tokens/s, until the first token
    finish_reason: FinishReason
    drafted_tokens: int = 0  # speculative decoding: drafted, and accepted by the model
    accepted_tokens: int = 0
    memory_by_rank: tuple[RankMemory, ...]


# One request, no prompt cache: how a one-shot launch serves.
ONE_REQUEST = ServingOptions(max_concurrency=1, prompt_cache_size=0)


def _jobs(
    model: str,
    plan: PipelinePlan,
    dtype: DType,
    source_port: int,
    adapter_path: str | None,
    serving: ServingOptions,
) -> list[Assignment]:
    hostfile: list[str] = [""] * plan.size
    for stage in plan.stages:  # one ring (and port range) per stage
        for rank, port in zip(stage.ranks, free_ports(stage.size), strict=True):
            hostfile[rank] = f"{ADDRESS}:{port}"
    conductor, *hops = free_ports(1 + (plan.size if len(plan.stages) > 1 else 0))
    return [
        Assignment(
            epoch=0,
            model=model,
            plan=plan,
            rank=rank,
            hostfile=tuple(hostfile),
            conductor=f"{ADDRESS}:{conductor}",
            requests_at=f"{ADDRESS}:{source_port}",
            hops=tuple(f"{ADDRESS}:{p}" for p in hops),
            dtype=dtype,
            measure_links=False,
            serving=serving,
            adapter_path=adapter_path,
        )
        for rank in range(plan.size)
    ]


@dataclass(frozen=True)
class RankNews:
    """The supervisor's news of one rank."""

    child: Child
    event: ProcessEvent


class JoinDeadline(Frozen):
    """The join timeout passed: every rank should be past joining its ring by now."""

    kind: Literal["join_deadline"] = "join_deadline"


LaunchEvent = RankNews | JoinDeadline | Hello | Delta | Done | RequestFailed
ConductorLink = Channel[Hello | Delta | Done | RequestFailed]


class _Launch:
    """What the launch hears, from any thread, in one queue."""

    def __init__(self) -> None:
        self.events: queue.Queue[LaunchEvent] = queue.Queue()
        self.conductor: ConductorLink | None = None

    def on_rank(self, child: Child, event: ProcessEvent) -> None:
        self.events.put(RankNews(child, event))

    def on_conductor(self, channel: ConductorLink) -> None:
        hello = channel.recv()
        if not isinstance(hello, Hello) or self.conductor is not None:
            channel.close()
            return
        self.conductor = channel
        self.events.put(hello)
        while (event := channel.recv()) is not None:
            self.events.put(event)


def _joined(child: Child) -> bool:
    """Past joining its ring (loading, serving, or gone)."""
    return child.phase is not None or child.state in ("ready", "exited")


def _failure(news: RankNews) -> ExoTpError | None:
    child = news.child
    if isinstance(news.event, Failed | Exited):  # a rank never leaves while the launch runs
        error = child.error or "exited with code 0"
        return ExoTpError(f"{child.name} {error}; stopped the other ranks")
    return None


def _generate(
    launch: _Launch,
    ranks: list[Child],
    request: GenerateRequest,
    join_timeout: float,
    joined: threading.Event,
) -> tuple[list[int], list[str], Done]:
    """Follow the ranks and the conductor until the answer is done, printing its text."""
    tokens: list[int] = []
    text: list[str] = []
    done: Done | None = None
    while done is None:
        event = launch.events.get()
        if isinstance(event, JoinDeadline):
            late = [r for r, child in enumerate(ranks) if not _joined(child)]
            if late:
                raise ExoTpError(f"ranks {late} did not join the ring within {join_timeout:.0f}s")
        elif isinstance(event, RankNews):
            if (error := _failure(event)) is not None:
                raise error
            if all(_joined(child) for child in ranks):
                joined.set()
        elif isinstance(event, Hello):
            assert launch.conductor is not None
            launch.conductor.send(Generate(request=request))
        elif isinstance(event, Delta):
            tokens.extend(event.tokens)
            text.append(event.text)
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, RequestFailed):
            raise ExoTpError(f"generation failed: {event.message}")
        elif isinstance(event, Done):
            done = event
    return tokens, text, done


def _report(done: Done, tokens: list[int], text: list[str], ranks: list[Child]) -> LaunchReport:
    decode = done.seconds - done.prompt_seconds
    return LaunchReport(
        tokens=tuple(tokens),
        text="".join(text),
        prompt_tokens=done.prompt_tokens,
        generation_tps=done.completion_tokens / decode if decode > 0 else 0.0,
        prompt_tps=done.prompt_tokens / done.prompt_seconds if done.prompt_seconds else 0.0,
        finish_reason=done.finish_reason,
        drafted_tokens=done.drafted_tokens,
        accepted_tokens=done.accepted_tokens,
        memory_by_rank=tuple(rank_memory(child) for child in ranks),
    )


def launch_local(
    model: str,
    plan: PipelinePlan,
    request: GenerateRequest,
    dtype: DType,
    report_out: str | None = None,
    join_timeout: float = 120.0,
    stall_timeout: float = 60.0,
    adapter_path: str | None = None,
    rank_env: Sequence[Mapping[str, str]] | None = None,
    serving: ServingOptions = ONE_REQUEST,
) -> LaunchReport:
    """Generate ``request`` on ``plan.size`` local ranks, printing the text to stdout; returns
    the report (also written to ``report_out``). Raises ExoTpError if a rank fails.
    ``rank_env``: variables added to each rank's environment (the lab's work factors)."""
    key = secrets.token_bytes(32)
    launch = _Launch()
    source = Listener(f"{ADDRESS}:0", key, CONDUCTOR_EVENTS, launch.on_conductor, "launch")
    supervisor = Supervisor(launch.on_rank, RANK_EVENTS, key, "launch supervisor")
    jobs = _jobs(model, plan, dtype, source.port, adapter_path, serving)
    ranks = [
        supervisor.start(
            rank_job(job, key, stall_timeout, rank_env[job.rank] if rank_env else None)
        )
        for job in jobs
    ]
    joined = threading.Event()
    timer = threading.Timer(
        join_timeout, lambda: joined.is_set() or launch.events.put(JoinDeadline())
    )
    timer.daemon = True
    timer.start()
    try:
        tokens, text, done = _generate(launch, ranks, request, join_timeout, joined)
        sys.stdout.write("\n")
        sys.stdout.flush()
        if launch.conductor is not None:  # the ranks see the epoch end and leave together
            launch.conductor.close()
        for child in ranks:
            try:
                child.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                break
    finally:
        joined.set()
        timer.cancel()
        source.close()
        supervisor.close()
    report = _report(done, tokens, text, ranks)
    log.info(
        "prompt %d tokens at %.1f tok/s; generated %d tokens at %.2f tok/s",
        done.prompt_tokens,
        report.prompt_tps,
        done.completion_tokens,
        report.generation_tps,
    )
    if report_out:
        Path(report_out).write_text(report.model_dump_json())
    return report
