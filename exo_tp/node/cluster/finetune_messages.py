"""What the leader and the nodes of a cluster tell each other about a fine-tuning job (typed, over
the signed control channel; pure: no MLX).

The leader sends every node of the job a `FinetuneAssign`: the job (its plan, hyper-parameters
and LoRA settings), the node's rank and the ring's addresses, the training data itself, and the
node's part of the weights transfer (its rows of the base). The node writes the data beside its
own copy of the job, fetches the rows it lacks, and starts its rank under its worker's
supervisor. It reports the rank in its status (`FinetuneRankStatus`), which the leader polls
every second; `FinetuneStop` ends the rank (cancel, or another rank failed).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from exo_tp.frozen import Frozen
from exo_tp.node.cluster.weight_orders import WeightOrder
from exo_tp.wire.finetune_job import FinetuneJob

RankState = Literal["fetching", "starting", "training", "done", "failed", "stopped"]


class FinetuneAssign(Frozen):
    job_id: str
    leader: str
    rank: int = Field(ge=0)
    hostfile: tuple[str, ...]  # "host:port" each rank's ring listens on, by rank
    # the job with this node's paths left for it to fill (model_dir, data_dir, adapter_path)
    job: FinetuneJob
    train: str  # train.jsonl's text
    valid: str = ""  # valid.jsonl's text (empty: no validation)
    weights: WeightOrder


class FinetuneAccepted(Frozen):
    job_id: str


class FinetuneStop(Frozen):
    job_id: str


class FinetuneStopped(Frozen):
    job_id: str


class FineTunedModel(Frozen):
    """A model a node's succeeded jobs made (in its status: every node lists the leader's)."""

    name: str  # ft:<base>:<suffix>:<job id>
    base: str
    created: int


class FinetuneRankStatus(Frozen):
    """One node's rank of a job, in its NodeStatus."""

    job_id: str
    rank: int
    state: RankState
    error: str | None = None
    fetched_bytes: int = 0  # base bytes it fetched from peers for its rows
    retained_bytes: int = 0  # of its rows, those it held already
    peak_memory: int = 0  # the rank's train peak (once done)
