"""Start N local ranks on the MLX ring backend and watch them until they finish.

Every rank is a child process with MLX_RANK and a private hostfile. Rank 0's stdout (the text)
streams through; every rank's stderr is forwarded. If a rank dies, the others are stopped and the
error names the rank instead of leaving them spinning in a collective.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

from exo_tp.errors import ExoTpError
from exo_tp.runtime.job import RANK_ENV, READY, LaunchJob
from exo_tp.runtime.ports import free_ports
from exo_tp.runtime.ring import ring_env, write_hostfile

POLL_SECONDS = 0.05


class _Rank:
    def __init__(self, rank: int, proc: subprocess.Popen[bytes]):
        self.rank = rank
        self.proc = proc
        self.ready = threading.Event()
        self.tail: deque[str] = deque(maxlen=20)
        self.threads: list[threading.Thread] = []

    def last_error(self) -> str:
        for line in reversed(self.tail):
            if "Error" in line or "error" in line:
                return line
        return self.tail[-1] if self.tail else "no output"


def _forward_stderr(rank: _Rank) -> None:
    assert rank.proc.stderr is not None
    for raw in rank.proc.stderr:
        line = raw.decode(errors="replace").rstrip("\n")
        if line == READY:
            rank.ready.set()
            continue
        rank.tail.append(line)
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _forward_stdout(rank: _Rank) -> None:
    assert rank.proc.stdout is not None
    out = sys.stdout.buffer if hasattr(sys.stdout, "buffer") else None
    while chunk := rank.proc.stdout.read1(4096):
        if out is not None:
            out.write(chunk)
            out.flush()
        else:
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()


def _rank_env(rank: int, local: int, stage_size: int, hostfile: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MLX_RANK", "MLX_HOSTFILE")}
    env[RANK_ENV] = str(rank)
    # A ring of one cannot connect to itself: a single-rank stage runs without a group.
    return {**env, **ring_env(local, hostfile)} if stage_size > 1 else env


def _stop_all(ranks: list[_Rank]) -> None:
    for r in ranks:
        if r.proc.poll() is None:
            r.proc.kill()
    for r in ranks:
        r.proc.wait()


def launch_local(job: LaunchJob, join_timeout: float = 120.0) -> None:
    """Run ``job`` on ``job.plan.size`` local ranks; raises ExoTpError if any rank fails."""
    n = job.plan.size
    stages = job.plan.stages
    speaker = stages[-1].ranks[0]  # the last stage's first rank prints the text
    with tempfile.TemporaryDirectory(prefix="exo-tp-launch-") as tmp:
        jobfile = Path(tmp) / "job.json"
        hostfiles = []
        for index, stage in enumerate(stages):  # one ring (and port range) per stage
            hostfiles.append(Path(tmp) / f"hostfile-{index}.json")
            write_hostfile(hostfiles[-1], [f"127.0.0.1:{p}" for p in free_ports(stage.size)])
        if len(stages) > 1:
            job = job.model_copy(update={"hops": tuple(f"127.0.0.1:{p}" for p in free_ports(n))})
        jobfile.write_text(job.model_dump_json())
        ranks: list[_Rank] = []
        try:
            for r in range(n):
                index, local = job.plan.locate(r)
                proc = subprocess.Popen(
                    [sys.executable, "-m", "exo_tp.runtime.worker", str(jobfile)],
                    env=_rank_env(r, local, stages[index].size, hostfiles[index]),
                    stdout=subprocess.PIPE if r == speaker else subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
                rank = _Rank(r, proc)
                rank.threads.append(threading.Thread(target=_forward_stderr, args=(rank,),
                                                     daemon=True))
                if r == speaker:
                    rank.threads.append(threading.Thread(target=_forward_stdout, args=(rank,),
                                                         daemon=True))
                for t in rank.threads:
                    t.start()
                ranks.append(rank)
            _watch(ranks, join_timeout)
        finally:
            _stop_all(ranks)
            for r in ranks:
                for t in r.threads:
                    t.join(timeout=2)


def _watch(ranks: list[_Rank], join_timeout: float) -> None:
    deadline = time.monotonic() + join_timeout
    while True:
        codes = [r.proc.poll() for r in ranks]
        failed = [r for r, code in zip(ranks, codes, strict=False) if code not in (None, 0)]
        if failed:
            first = failed[0]
            for t in first.threads:
                t.join(timeout=1)  # let its last words arrive
            raise ExoTpError(
                f"rank {first.rank} exited with code {first.proc.returncode} "
                f"({first.last_error()}); stopped the other ranks"
            )
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > deadline and not all(r.ready.is_set() for r in ranks):
            missing = [r.rank for r in ranks if not r.ready.is_set()]
            raise ExoTpError(f"ranks {missing} did not join the ring within {join_timeout:.0f}s")
        time.sleep(POLL_SECONDS)
