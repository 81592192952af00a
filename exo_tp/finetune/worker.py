"""One rank of a fine-tuning job: join the ring, train, report.

Run as ``python -m exo_tp.finetune.worker JOB.json`` with EXO_TP_FINETUNE_RANK, the
supervisor's link (`exo_tp.process.child`) and, for more than one rank, MLX_RANK / MLX_HOSTFILE
set (by exo_tp.finetune.launcher). It tells its supervisor Ready once it joined the ring, then
its report (`RankDone`), or why it failed.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

from exo_tp.process.child import SupervisorLink, run_child
from exo_tp.process.lifecycle import die_with_parent
from exo_tp.process.messages import Ready
from exo_tp.transport.ring import barrier, init_ring
from exo_tp.wire.finetune_job import (
    RANK_ENV,
    FinetuneJob,
    RankDone,
    RankProgress,
    StepReport,
    ValReport,
)


def train(link: SupervisorLink, rank: int) -> None:
    job = FinetuneJob.model_validate_json(Path(sys.argv[1]).read_text())
    group = init_ring()  # before loading: a peer that never comes must not cost a load first
    link.send(Ready())
    from exo_tp.finetune.train import run_rank  # after joining: imports take seconds

    def progress(report: StepReport | ValReport) -> None:
        if isinstance(report, StepReport):
            link.send(RankProgress(steps=report.iteration, train=report))
        else:
            link.send(RankProgress(steps=report.iteration, val=report))

    report = run_rank(job, rank, group, progress)
    link.send(RankDone(report=report))
    barrier(group)


def main() -> None:
    die_with_parent()
    # Ctrl-C reaches the whole process group; the job's supervisor stops its ranks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rank = int(os.environ.get(RANK_ENV, "0"))
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s rank {rank} %(levelname)s %(message)s",
    )
    run_child(lambda link: train(link, rank))


if __name__ == "__main__":
    main()
