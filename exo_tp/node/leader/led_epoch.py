"""The leader's record of an epoch it formed: members, plan, ranks, state (exo_tp.node.leader
.formation forms and tracks it; the live balance and the views read it)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from exo_tp.node.control_messages import EpochState
from exo_tp.plan.pipeline import PipelinePlan
from exo_tp.plan.predict import Prediction
from exo_tp.wire.ids import Epoch, NodeId


@dataclass
class LedEpoch:
    """The leader's record of the cluster it formed."""

    number: Epoch
    nodes: tuple[NodeId, ...]  # node id per global rank
    plan: PipelinePlan | None  # None until planned
    members: tuple[NodeId, ...] = ()  # every eligible member it was formed for
    model: str | None = None  # the key of the model it serves
    prediction: Prediction | None = None  # the cost model's, when planned from profiles
    state: EpochState = "loading"
    started: float = field(default_factory=time.monotonic)
    reason: str = ""
    conductor_lost: float | None = None  # monotonic time the conductor's link dropped
    adapter_job: str | None = None  # the fine-tuning job whose adapter every shard carries
    symptom_seen: float | None = None  # monotonic time a rank first exited on a broken link

    def conductor_rank(self) -> int | None:
        if self.plan is None or self.plan.stages[-1].ranks[0] >= len(self.nodes):
            return None
        return self.plan.stages[-1].ranks[0]


def rank_name(led: LedEpoch, node_id: NodeId) -> str:
    """ "rank 2 on node local-2" (several ranks on one node are all named)."""
    ranks = [str(r) for r, n in enumerate(led.nodes) if n == node_id]
    which = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(ranks)}"
    return f"{which} on node {node_id}"
