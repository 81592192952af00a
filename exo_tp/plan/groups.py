"""A cluster plan of groups: several models resident at once, each served by its own group (or
replicas) over a set of devices (pure).

Models are placed one after another in the order given (the pinned ones, those named at start,
first): each is planned by `exo_tp.plan.replicas.choose_replicas` on the memory the groups
before it left on every device, so two groups share a device wherever its memory holds both.
A model that no longer fits is refused with the memory it needs and the memory left, which is
what a request naming it is told (or what evicting a least recently used group must free).

Sharing a device shares its compute too: two groups decoding at once on one device each run
slower than priced. The prediction of each group is its speed alone, which is what it runs at
when the other is idle (the usual case for a team's second model).
"""

from __future__ import annotations

from collections.abc import Sequence

from exo_tp.errors import PlanError
from exo_tp.plan.cluster import Cluster
from exo_tp.plan.draft import draft_cost
from exo_tp.plan.human import size
from exo_tp.plan.kv_width import FLOAT_KV, KvShape
from exo_tp.plan.replicas import ReplicaChoice, choose_replicas
from exo_tp.plan.search import ObjectiveChoice
from exo_tp.plan.spec import Frozen, ModelSpec


class GroupModel(Frozen):
    """A model to place: its key (what requests name), its spec, the cluster priced for it
    (devices read each model at their own speed, `exo_tp.plan.of_model.profiled_cluster`),
    and whether it is pinned."""

    key: str
    spec: ModelSpec
    cluster: Cluster
    pinned: bool = False
    context_tokens: int | None = None  # the context its KV cache must hold (None: the model's)


class Group(Frozen):
    key: str
    pinned: bool
    choice: ReplicaChoice

    def devices(self) -> tuple[int, ...]:
        """Every device of the cluster this group holds memory on."""
        return tuple(sorted(self.choice.best.memory()))


class GroupsPlan(Frozen):
    groups: tuple[Group, ...]
    memory: tuple[int, ...]  # bytes each device allows for models
    left: tuple[int, ...]  # bytes each device has left once every group is placed

    def group(self, key: str) -> Group | None:
        return next((g for g in self.groups if g.key == key), None)


def with_memory(cluster: Cluster, memory: Sequence[int]) -> Cluster:
    """``cluster`` whose devices allow ``memory`` bytes each (what other groups left)."""
    devices = tuple(
        d.model_copy(update={"memory": max(0, m)})
        for d, m in zip(cluster.devices, memory, strict=True)
    )
    return cluster.model_copy(update={"devices": devices})


def weights_needed(spec: ModelSpec) -> int | None:
    """Bytes of the whole model's weights (its tower included), as one device would hold them
    (None: a family the planner cannot size whole)."""
    try:
        return draft_cost(spec, "").weights + spec.vision_bytes + spec.mtp_bytes
    except (ValueError, PlanError):
        return None


def _refusal(model: GroupModel, error: PlanError, left: Sequence[int]) -> str:
    needed = weights_needed(model.spec)
    need = "" if needed is None else f": its weights alone need {size(needed)}"
    free = ", ".join(
        f"{d.name} {size(m)}" for d, m in zip(model.cluster.devices, left, strict=True)
    )
    return f"{model.key} does not fit beside the models resident{need}; left: {free} ({error})"


def place_groups(
    models: Sequence[GroupModel],
    objective: ObjectiveChoice = "latency",
    queue: int = 0,
    kv: KvShape = FLOAT_KV,
) -> GroupsPlan:
    """Every model of ``models`` placed in order on what the ones before it left; a model that
    does not fit raises `PlanError` saying the memory it needs and the memory left."""
    if not models:
        raise PlanError("no model to place")
    memory = tuple(d.memory for d in models[0].cluster.devices)
    if any(len(m.cluster.devices) != len(memory) for m in models):
        raise PlanError("every model must be priced on the same devices")
    left = list(memory)
    groups: list[Group] = []
    for model in models:
        try:
            choice = choose_replicas(
                model.spec,
                with_memory(model.cluster, left),
                objective,
                queue,
                context_tokens=model.context_tokens,
                kv=kv,
            )
        except PlanError as error:
            raise PlanError(_refusal(model, error, left)) from None
        for device, held in choice.best.memory().items():
            left[device] -= held
        groups.append(Group(key=model.key, pinned=model.pinned, choice=choice))
    return GroupsPlan(groups=tuple(groups), memory=memory, left=tuple(left))
