"""Placement: where a model goes in one epoch, computed once, from facts only (pure; no I/O,
no MLX).

Given the model, the eligible members (share weights, memory, prefill scores) and what each
member holds of the model's weights, it chooses:

- the plan: forced pipeline stages and manual weights plan as told; members that all announced
  measured speeds let the planner search (it may leave slow members out); otherwise one
  tensor-parallel stage over every member;
- the rank order: with one stage, when some chosen member lacks the files, the order of the
  chosen members over ranks that moves the fewest bytes (shares follow the nodes);
- the transfers: who fetches which bytes from whom (None when every chosen member loads from
  its own files);
- the planner's prediction (when it searched).

The leader gathers the facts (exo_tp.node.formation, exo_tp.node.cluster_model) and turns the
placement into assignments and weight orders.
"""

from __future__ import annotations

from exo_tp.frozen import Frozen
from exo_tp.plan import ModelSpec, plan_tensor_parallel
from exo_tp.plan.cluster import MEMORY_HEADROOM, Cluster, DeviceCost
from exo_tp.plan.matvec import MatvecTable
from exo_tp.plan.pipeline import PipelinePlan, plan_pipeline, single_stage
from exo_tp.plan.predict import Prediction
from exo_tp.plan.render_choice import describe_candidate
from exo_tp.plan.search import ObjectiveChoice, choose_plan
from exo_tp.weights.manifest import ModelManifest
from exo_tp.weights.transfer import (
    Holding,
    TransferError,
    TransferPlan,
    choose_rank_order,
    plan_transfer,
)

# A member that announced no memory figure is not limited by the planner.
UNKNOWN_MEMORY = 1 << 50


class Member(Frozen):
    """One eligible member, as placement sees it."""

    node_id: str
    # share weight: its manual --weight, or decode bytes/s of the model (at its measured
    # matrix shapes when it has them, else the decode score for the model's format)
    weight: float
    # the model's matrix shapes it measured (exo-tp bench --model), at its live speed
    matvec: MatvecTable = MatvecTable()
    prefill_flops: float = 0.0  # announced; 0: unknown
    layer_overhead: float = 0.0  # seconds per layer per token, announced; 0: unknown
    memory_available: int = 0  # bytes, announced; 0: unknown


class Members(Frozen):
    """The eligible members, in the planner's device order (the leader first, then by id)."""

    members: tuple[Member, ...]
    measured: bool  # every weight is a measured speed: the planner searches
    stages: tuple[int, ...] = ()  # forced pipeline stages (ranks per stage); () for none


class Holdings(Frozen):
    """What the members hold of the model's weights."""

    files: frozenset[str]  # members with the model's folder (every byte)
    # Known when some member lacks the files (the leader then asked the holders for it).
    manifest: ModelManifest | None = None
    held: tuple[Holding, ...] = ()  # per member: its files or its shard store of ``manifest``


class Placement(Frozen):
    plan: PipelinePlan
    rank_order: tuple[str, ...]  # the member at each global rank
    transfers: TransferPlan | None  # None: every chosen member loads from its own files
    prediction: Prediction | None  # the planner's, when it searched
    notes: tuple[str, ...] = ()  # how the planner chose (for the log)


def planner_cluster(members: Members) -> Cluster:
    """Devices at the members' speeds (decode bytes/s for the model), weight reads priced by
    their measured shapes where they have them, with their announced prefill scores and
    memory; links are assumed (the planner's default LAN link): a cluster measures its links
    only once its workers run."""
    return Cluster(
        devices=tuple(
            DeviceCost(
                name=m.node_id,
                # With shapes, every matrix is priced by them; what is left (the norms) reads
                # at the model's mean speed.
                seconds_per_byte=1.0 / m.weight,
                prefill_flops=m.prefill_flops if m.prefill_flops > 0 else 1e9,
                layer_overhead=m.layer_overhead,
                memory=int(m.memory_available * MEMORY_HEADROOM)
                if m.memory_available
                else UNKNOWN_MEMORY,
                matvec=m.matvec,
                read_speed=m.weight if m.matvec.points else 0.0,
            )
            for m in members.members
        )
    )


def plan_of(
    spec: ModelSpec,
    cluster: Members,
    objective: ObjectiveChoice = "latency",
    queue: int = 0,
) -> tuple[PipelinePlan, tuple[str, ...], Prediction | None, tuple[str, ...]]:
    """The plan, the member at each rank, the prediction and the planner's notes."""
    names = tuple(m.node_id for m in cluster.members)
    weights = [m.weight for m in cluster.members]
    stages = cluster.stages
    if stages and sum(stages) == len(names):
        groups, start = [], 0
        for size in stages:
            groups.append(weights[start : start + size])
            start += size
        return plan_pipeline(spec, groups), names, None, ()
    if cluster.measured:
        choice = choose_plan(spec, planner_cluster(cluster), objective=objective, queue=queue)
        runner_ups = "; ".join(
            f"{c.prediction.tokens_per_second:.3g} tok/s {describe_candidate(c, list(names))}"
            for c in choice.alternatives
        )
        shaped = [
            f"{m.node_id} ({len(m.matvec.points)})" for m in cluster.members if m.matvec.points
        ]
        notes = (
            f"planner: {describe_candidate(choice.best, list(names))} "
            f"(objective {choice.objective}: {choice.reason}); runner-ups: {runner_ups}; "
            f"weight reads priced by measured shapes: {', '.join(shaped) or 'none'} "
            "(the others by their decode score)",
        )
        chosen = tuple(names[d] for d in choice.best.devices)
        return choice.best.plan, chosen, choice.best.prediction, notes
    return single_stage(plan_tensor_parallel(spec, weights)), names, None, ()


def place(
    spec: ModelSpec,
    cluster: Members,
    holdings: Holdings,
    objective: ObjectiveChoice = "latency",
    queue: int = 0,
) -> Placement:
    """Plan, rank order, transfers and prediction of one epoch (see the module's notes);
    ``queue``: requests running or waiting as it plans (the auto objective goes by it)."""
    plan, order, prediction, notes = plan_of(spec, cluster, objective, queue)
    if all(n in holdings.files for n in order):
        return Placement(
            plan=plan, rank_order=order, transfers=None, prediction=prediction, notes=notes
        )
    manifest = holdings.manifest
    if manifest is None:
        missing = [n for n in order if n not in holdings.files]
        raise TransferError(f"{', '.join(missing)} lack the files and no manifest is known")
    if len(plan.stages) == 1:
        weight_of = dict(zip(order, plan.stages[0].tp.weights, strict=True))
        planned = plan

        def plan_for(candidate: tuple[str, ...]) -> PipelinePlan:
            if candidate == order:
                return planned
            return single_stage(plan_tensor_parallel(spec, [weight_of[n] for n in candidate]))

        order, plan = choose_rank_order(manifest, order, plan_for, holdings.held)
    transfers = plan_transfer(manifest, plan, order, holdings.held)
    return Placement(
        plan=plan, rank_order=order, transfers=transfers, prediction=prediction, notes=notes
    )
