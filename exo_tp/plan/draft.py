"""A draft model's memory in the plan (speculative decoding, `--draft-model`; pure).

The draft runs whole in the conductor's process (exo_tp.runtime.draft_model says why), so its
weights and the KV cache of the one stream that speculates sit on the conductor's device (the
first rank of the last stage), beside that rank's shard.
"""

from __future__ import annotations

from exo_tp.plan.cost import rank_load
from exo_tp.plan.pipeline import PipelinePlan
from exo_tp.plan.shard_plan import Span
from exo_tp.plan.spec import Frozen, ModelSpec
from exo_tp.plan.tensor_parallel import plan_tensor_parallel


class DraftCost(Frozen):
    """The draft model's bytes on the conductor's device: its weights, and its KV cache per
    token of the speculating stream's context."""

    name: str
    weights: int
    kv_per_token: int

    def bytes_at(self, context_tokens: int) -> int:
        return self.weights + self.kv_per_token * context_tokens


def draft_cost(spec: ModelSpec, name: str) -> DraftCost:
    """What the draft model ``spec`` (named ``name``) holds, whole on one rank."""
    whole = plan_tensor_parallel(spec, [1.0]).ranks[0]
    load = rank_load(spec, whole, Span(start=0, stop=spec.num_layers), True, True)
    return DraftCost(name=name, weights=load.held_bytes, kv_per_token=load.kv_bytes_per_token)


def draft_rank(plan: PipelinePlan) -> int:
    """The rank whose device holds the draft: the conductor's, the last stage's first."""
    return plan.stages[-1].ranks[0]
