"""A serving rank as a job of the one supervisor (`exo_tp.process.supervisor`): for `exo-tp
launch` (every rank of a job on this machine) and the node daemon (its one rank per epoch).

Each rank gets a private folder (its job, its stage's hostfile) named after this process, so a
later start on the machine removes the folders of supervisors that died (kill -9) without
cleaning up.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from exo_tp.plan.rebalance import RankSpeed
from exo_tp.process.blas import group_threads
from exo_tp.process.supervisor import (
    Child,
    Job,
    clean_environment,
    private_folder,
    remove_orphaned_folders,
)
from exo_tp.transport.ring import jaccl_env, ring_env, write_hostfile
from exo_tp.wire.assignment import LINK_KEY_ENV, Assignment
from exo_tp.wire.runtime import Heartbeat, RankMemory, Ready

FOLDER_PREFIX = "exo-tp-rank-"


def rank_environment(
    job: Assignment, folder: Path, key: bytes, extra_env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The rank's environment: `clean_environment` and ``extra_env``, plus its link key, its
    part of the host's cores for OpenBLAS (a BLAS preloaded by ``extra_env`` included), and its
    stage's group (none for a stage of one rank)."""
    env = {**clean_environment(), **(extra_env or {})}
    env[LINK_KEY_ENV] = key.hex()
    env.update(group_threads(job.hostfile, job.rank, env))
    stage = job.plan.stages[job.stage_index]
    if stage.size > 1 and job.backend == "jaccl":
        devices = folder / "ibv_devices.json"
        matrix = job.ibv_devices or ()
        devices.write_text(json.dumps([[matrix[i][j] for j in stage.ranks] for i in stage.ranks]))
        # the stage's first ring address is free under jaccl: its coordinator listens there
        env.update(jaccl_env(job.local_rank, job.hostfile[stage.ranks[0]], devices))
    elif stage.size > 1:
        hostfile = folder / "hostfile.json"
        write_hostfile(hostfile, [job.hostfile[r] for r in stage.ranks])
        env.update(ring_env(job.local_rank, hostfile, env))
    return env


def rank_job(
    job: Assignment,
    key: bytes,
    stall_timeout: float,
    extra_env: Mapping[str, str] | None = None,
) -> Job:
    """The supervisor's job for one rank; its folder (job file, hostfile) is made here and
    removed with the rank. ``extra_env`` is added to its environment (the lab's work factor).
    Ranks never write to stdout (`exo-tp launch` prints only the text there)."""
    remove_orphaned_folders(FOLDER_PREFIX)
    folder = private_folder(FOLDER_PREFIX)
    jobfile = folder / "job.json"
    jobfile.write_text(job.model_dump_json())
    return Job(
        name=f"rank {job.rank}",
        module="exo_tp.runtime.rank",
        argv=(str(jobfile),),
        env=rank_environment(job, folder, key, extra_env),
        stall_timeout=stall_timeout,
        folder=str(folder),
        stdout="stderr",
    )


def rank_memory(child: Child) -> RankMemory:
    """The rank's latest memory report (its heartbeat's, else its Ready's)."""
    if isinstance(child.heartbeat, Heartbeat):
        return child.heartbeat.memory
    if isinstance(child.ready, Ready):
        return child.ready.memory
    return RankMemory()


def rank_ready(child: Child) -> Ready | None:
    return child.ready if isinstance(child.ready, Ready) else None


def rank_speed(child: Child) -> RankSpeed | None:
    """The rank's latest live speed sample (its heartbeats repeat the last one; None until
    its probe has timed a pass, or when it does not probe)."""
    return child.heartbeat.speed if isinstance(child.heartbeat, Heartbeat) else None
