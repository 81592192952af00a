"""Start a fine-tuning job's ranks on this machine and watch them until they finish.

One child process per rank, on the MLX ring over 127.0.0.1 with ports the kernel just handed
out (a private range per job). Rank 0's progress (mlx-lm's trainer output) and every rank's
stderr are forwarded to stderr. If a rank dies the others are stopped and the error names it;
each rank writes its report (a RankReport) as JSON, read back here.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import IO

from exo_tp.errors import ExoTpError
from exo_tp.finetune.job import RANK_ENV, READY, FinetuneJob, RankReport
from exo_tp.frozen import replace
from exo_tp.runtime.supervisor import clean_environment
from exo_tp.transport.ports import free_ports
from exo_tp.transport.ring import ring_env, write_hostfile

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
            if "rror" in line:
                return line.removeprefix("exo-tp: error: ")
        return self.tail[-1] if self.tail else "no output"


def _forward(rank: _Rank, stream: IO[bytes], keep: bool) -> None:
    for raw in stream:
        line = raw.decode(errors="replace").rstrip("\n")
        if line == READY:
            rank.ready.set()
            continue
        if keep:
            rank.tail.append(line)
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _env(rank: int, size: int, hostfile: Path) -> dict[str, str]:
    env = clean_environment()
    env[RANK_ENV] = str(rank)
    return {**env, **ring_env(rank, hostfile)} if size > 1 else env


def run_local(job: FinetuneJob, join_timeout: float = 120.0) -> list[RankReport]:
    """Train on ``job.plan.size`` local ranks; the ranks' reports in rank order."""
    n = job.plan.size
    with tempfile.TemporaryDirectory(prefix="exo-tp-finetune-") as tmp:
        hostfile, jobfile = Path(tmp) / "hostfile.json", Path(tmp) / "job.json"
        write_hostfile(hostfile, [f"127.0.0.1:{p}" for p in free_ports(n)])
        job = replace(job, report_dir=tmp)
        jobfile.write_text(job.model_dump_json())
        ranks: list[_Rank] = []
        try:
            for r in range(n):
                proc = subprocess.Popen(
                    [sys.executable, "-m", "exo_tp.finetune.worker", str(jobfile)],
                    env=_env(r, n, hostfile),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
                rank = _Rank(r, proc)
                assert proc.stderr is not None
                rank.threads.append(
                    threading.Thread(target=_forward, args=(rank, proc.stderr, True), daemon=True)
                )
                if proc.stdout is not None:
                    rank.threads.append(
                        threading.Thread(
                            target=_forward, args=(rank, proc.stdout, False), daemon=True
                        )
                    )
                for t in rank.threads:
                    t.start()
                ranks.append(rank)
            _watch(ranks, join_timeout)
        finally:
            _stop_all(ranks)
        return [
            RankReport.model_validate_json((Path(tmp) / f"rank-{r}.json").read_text())
            for r in range(n)
        ]


def _stop_all(ranks: list[_Rank]) -> None:
    for r in ranks:
        if r.proc.poll() is None:
            r.proc.kill()
    for r in ranks:
        r.proc.wait()
        for t in r.threads:
            t.join(timeout=2)


def _watch(ranks: list[_Rank], join_timeout: float) -> None:
    deadline = time.monotonic() + join_timeout
    while True:
        codes = [r.proc.poll() for r in ranks]
        failed = [r for r, code in zip(ranks, codes, strict=True) if code not in (None, 0)]
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
