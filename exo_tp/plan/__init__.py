"""Pure planning: model dims + device weights -> a serializable shard plan. No MLX here."""

from exo_tp.plan.shard_plan import Collective, HeadShard, RankShard, ShardPlan, Span
from exo_tp.plan.spec import ModelSpec, Quantization, load_spec, spec_from_config
from exo_tp.plan.tensor_parallel import plan_tensor_parallel

__all__ = [
    "Collective",
    "HeadShard",
    "ModelSpec",
    "Quantization",
    "RankShard",
    "ShardPlan",
    "Span",
    "load_spec",
    "plan_tensor_parallel",
    "spec_from_config",
]
