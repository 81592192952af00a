"""Start a fine-tuning job's ranks on this machine and watch them until they finish.

One child process per rank (`exo_tp.finetune.worker`), started by the one supervisor
(`exo_tp.process.supervisor`), on the MLX ring over 127.0.0.1 with ports the kernel just handed
out (a private range per job). Rank 0's progress (mlx-lm's trainer output) and every rank's
stderr go to stderr. Each rank tells the supervisor when it joined the ring, then sends its
report (a RankReport), or why it failed; if one dies the others are stopped and the error
names it.
"""

from __future__ import annotations

import queue
import tempfile
import time
from pathlib import Path

from exo_tp.errors import ExoTpError
from exo_tp.process.blas import share_cores
from exo_tp.process.events import Exited, Failed, ProcessEvent
from exo_tp.process.supervisor import Child, Job, Supervisor, clean_environment
from exo_tp.transport.ports import free_ports
from exo_tp.transport.ring import ring_env, write_hostfile
from exo_tp.wire.finetune_job import RANK_ENV, RANK_EVENTS, FinetuneJob, RankDone, RankReport


def _env(rank: int, size: int, hostfile: Path) -> dict[str, str]:
    env = clean_environment()
    env[RANK_ENV] = str(rank)
    env.update(share_cores(size, env))  # every rank on this machine
    return {**env, **ring_env(rank, hostfile, env)} if size > 1 else env


def run_local(job: FinetuneJob, join_timeout: float = 120.0) -> list[RankReport]:
    """Train on ``job.plan.size`` local ranks; the ranks' reports in rank order."""
    n = job.plan.size
    events: queue.Queue[tuple[Child, ProcessEvent]] = queue.Queue()
    supervisor = Supervisor(
        lambda child, event: events.put((child, event)), RANK_EVENTS, name="finetune supervisor"
    )
    try:
        with tempfile.TemporaryDirectory(prefix="exo-tp-finetune-") as tmp:
            hostfile, jobfile = Path(tmp) / "hostfile.json", Path(tmp) / "job.json"
            write_hostfile(hostfile, [f"127.0.0.1:{p}" for p in free_ports(n)])
            jobfile.write_text(job.model_dump_json())
            ranks = [
                supervisor.start(
                    Job(
                        name=f"rank {r}",
                        module="exo_tp.finetune.worker",
                        argv=(str(jobfile),),
                        env=_env(r, n, hostfile),
                        stdout="stderr" if r == 0 else "null",
                    )
                )
                for r in range(n)
            ]
            _watch(ranks, events, join_timeout)
    finally:
        supervisor.close()
    return [_report(child) for child in ranks]


def _report(child: Child) -> RankReport:
    if not isinstance(child.result, RankDone):
        raise ExoTpError(f"{child.name} exited without a report")
    return child.result.report


def _watch(
    ranks: list[Child], events: queue.Queue[tuple[Child, ProcessEvent]], join_timeout: float
) -> None:
    """Until every rank exited cleanly; raises on the first that fails, or when some have not
    joined the ring in time."""
    deadline = time.monotonic() + join_timeout
    exited: set[str] = set()
    while len(exited) < len(ranks):
        joined = all(child.ready is not None for child in ranks)
        try:
            child, event = events.get(timeout=None if joined else deadline - time.monotonic())
        except (queue.Empty, ValueError):  # ValueError: the deadline already passed
            missing = [r for r, child in enumerate(ranks) if child.ready is None]
            raise ExoTpError(
                f"ranks {missing} did not join the ring within {join_timeout:.0f}s"
            ) from None
        if isinstance(event, Failed):
            raise ExoTpError(
                f"{child.name} exited with code {child.process.returncode} "
                f"({child.reported or 'no report'}); stopped the other ranks"
            )
        if isinstance(event, Exited):
            exited.add(child.token)
