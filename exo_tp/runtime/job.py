"""What a rank is asked to do, serialized to every worker process (no MLX here)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from exo_tp.plan.pipeline import PipelinePlan
from exo_tp.plan.predict import Prediction
from exo_tp.plan.spec import Frozen
from exo_tp.runtime.messages import SamplingParams

RANK_ENV = "EXO_TP_RANK"  # a worker's global rank (MLX_RANK is its rank inside its stage)
SECRET_ENV = "EXO_TP_SECRET"  # the cluster secret, for a worker's signed hello to the leader
READY = "exo-tp:ready"  # status line a worker prints on stderr once it joined the ring

DType = Literal["float32", "float16", "bfloat16", "auto"]


class LaunchJob(Frozen):
    """A one-shot generation on a local ring of ranks."""

    model_dir: str
    plan: PipelinePlan
    prompt: str
    use_chat_template: bool = True
    sampling: SamplingParams = SamplingParams()
    # Compute dtype of floating parameters; "auto" keeps the checkpoint's.
    dtype: DType = "float32"
    # Optional files rank 0 writes for checking against a reference.
    logits_out: str | None = None
    report_out: str | None = None
    # Pipelines: the "ip:port" each global rank's incoming hop listens on.
    hops: tuple[str, ...] = ()
    # An mlx-lm LoRA adapter folder applied (unfused) to every rank's shard.
    adapter_path: str | None = None


class Assignment(Frozen):
    """A node's part in a cluster epoch: which rank its worker is and how to reach the others."""

    epoch: int = Field(ge=0)
    model: str  # a prepared model name or a folder present on every node
    plan: PipelinePlan
    rank: int = Field(ge=0)  # global rank
    hostfile: tuple[str, ...]  # "ip:port" each global rank's ring socket listens on
    conductor: str  # "ip:port" where the last stage's first rank meets its stage peers
    requests_at: str  # "ip:port" of the leader's request channel the conductor joins
    hops: tuple[str, ...] = ()  # pipelines: "ip:port" of each global rank's incoming hop
    nodes: tuple[str, ...] = ()  # node id per global rank
    dtype: DType = "float32"
    backend: Literal["ring", "jaccl"] = "ring"
    # jaccl only: ibverbs device from rank i to rank j (None on the diagonal)
    ibv_devices: tuple[tuple[str | None, ...], ...] | None = None
    prediction: Prediction | None = None  # the planner's cost model for this plan, if any
