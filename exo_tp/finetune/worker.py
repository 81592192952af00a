"""One rank of a fine-tuning job: join the ring, train, write its report.

Run as ``python -m exo_tp.finetune.worker JOB.json`` with EXO_TP_FINETUNE_RANK and, for more
than one rank, MLX_RANK / MLX_HOSTFILE set (by exo_tp.finetune.launcher).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from exo_tp.errors import ExoTpError
from exo_tp.finetune.job import RANK_ENV, READY, FinetuneJob
from exo_tp.process.lifecycle import die_with_parent
from exo_tp.transport.ring import barrier, init_ring


def main() -> int:
    die_with_parent()
    rank = int(os.environ.get(RANK_ENV, "0"))
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s rank {rank} %(levelname)s %(message)s",
    )
    job = FinetuneJob.model_validate_json(Path(sys.argv[1]).read_text())
    group = init_ring()  # before loading: a peer that never comes must not cost a load first
    print(READY, file=sys.stderr, flush=True)
    from exo_tp.finetune.train import run_rank  # after joining: imports take seconds

    try:
        report = run_rank(job, rank, group)
    except ExoTpError as error:
        print(f"exo-tp: error: {error}", file=sys.stderr, flush=True)
        return 1
    Path(job.report_dir, f"rank-{rank}.json").write_text(report.model_dump_json())
    barrier(group)
    return 0


if __name__ == "__main__":
    sys.exit(main())
