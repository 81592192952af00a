"""Pure planning: model dims + device weights -> a serializable shard plan. No MLX here."""

import sys
import types
from typing import Any

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


class _PlanPackage(types.ModuleType):
    """`exo_tp.plan` is this package and the library's `exo_tp.plan(model, ...)` at once: Python
    binds a package's attribute to a subpackage once it is imported, so a function named `plan`
    in `exo_tp` would be replaced by this module the first time anything imported
    `exo_tp.plan.*`. Calling the package calls the function (exo_tp.plan.of_model)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from exo_tp.plan.of_model import plan

        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _PlanPackage
