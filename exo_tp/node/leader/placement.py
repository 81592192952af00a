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

The leader gathers the facts (exo_tp.node.leader.formation, exo_tp.node.leader.cluster_model)
and turns the placement into assignments and weight orders.
"""

from __future__ import annotations

import logging

from exo_tp.arch import table_for
from exo_tp.errors import ExoTpError
from exo_tp.frozen import Frozen
from exo_tp.plan import ModelSpec, plan_tensor_parallel
from exo_tp.plan.cluster import Cluster, cluster_from_profiles, pricing_note
from exo_tp.plan.draft import DraftCost, draft_cost
from exo_tp.plan.pipeline import PipelinePlan, plan_pipeline, plan_unsplit, single_stage
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
from exo_tp.wire.assignment import ServingOptions
from exo_tp.wire.ids import NodeId
from exo_tp.wire.profiles import LinkProfile, ProfileSummary

log = logging.getLogger(__name__)


class Member(Frozen):
    """One eligible member, as placement sees it."""

    node_id: NodeId
    # share weight: its manual --weight, or decode bytes/s of the model (at its measured
    # matrix shapes when it has them, else the decode score for the model's format), live
    weight: float
    profile: ProfileSummary | None = None  # what the planner prices it by (None: no profile)
    slowdown: float = 1.0  # times slower than its profile it runs now (live rebalancing)
    memory_available: int = 0  # bytes, announced; 0: unknown (the profile's figure then)


class Members(Frozen):
    """The eligible members, in the planner's device order (the leader first, then by id)."""

    members: tuple[Member, ...]
    # every member has a profile and none set a manual weight: the planner searches
    measured: bool
    stages: tuple[int, ...] = ()  # forced pipeline stages (ranks per stage); () for none
    # links the members measured to each other (their probes, labelled by node id)
    links: tuple[LinkProfile, ...] = ()


class Holdings(Frozen):
    """What the members hold of the model's weights."""

    files: frozenset[NodeId]  # members with the model's folder (every byte)
    # Known when some member lacks the files (the leader then asked the holders for it).
    manifest: ModelManifest | None = None
    held: tuple[Holding, ...] = ()  # per member: its files or its shard store of ``manifest``


class Placement(Frozen):
    plan: PipelinePlan
    rank_order: tuple[NodeId, ...]  # the member at each global rank
    transfers: TransferPlan | None  # None: every chosen member loads from its own files
    prediction: Prediction | None  # the planner's, when it searched
    notes: tuple[str, ...] = ()  # how the planner chose (for the log)


def planner_cluster(spec: ModelSpec, members: Members) -> Cluster:
    """The planner's cluster for measured members: the one cluster model `exo-tp plan` builds
    too (exo_tp.plan.cluster.cluster_from_profiles), from the members' profiles, their live
    slowdowns and memory, and the links measured between them."""
    profiles = [m.profile for m in members.members]
    if any(p is None for p in profiles):
        raise ValueError("the planner needs every member's profile")
    return cluster_from_profiles(
        spec,
        [p for p in profiles if p is not None],
        names=[m.node_id for m in members.members],
        links=members.links,
        slowdown=[m.slowdown for m in members.members],
        memory=[m.memory_available for m in members.members],
    )


def serving_draft(serving: ServingOptions) -> DraftCost | None:
    """The draft model's memory for the planner, from the leader's own files of it (the
    conductor's node loads it; a leader without it plans without it, and says so). None where
    no plan would load it (a quantized KV cache never speculates)."""
    draft_model = serving.draft_model
    if draft_model is None or not serving.loads_draft():
        return None
    from exo_tp.models.registry import resolve_model
    from exo_tp.plan.spec import load_spec

    try:
        return draft_cost(load_spec(resolve_model(draft_model)), draft_model)
    except (ExoTpError, ValueError, OSError) as error:
        log.warning("the draft model %s is left out of the plan's memory: %s", draft_model, error)
        return None


def plan_of(
    spec: ModelSpec,
    cluster: Members,
    objective: ObjectiveChoice = "latency",
    queue: int = 0,
    draft: DraftCost | None = None,
) -> tuple[PipelinePlan, tuple[NodeId, ...], Prediction | None, tuple[str, ...]]:
    """The plan, the member at each rank, the prediction and the planner's notes (``draft``:
    a draft model beside the conductor, in the measured planner's memory)."""
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
        devices = planner_cluster(spec, cluster)
        choice = choose_plan(spec, devices, objective=objective, queue=queue, draft=draft)
        runner_ups = "; ".join(
            f"{c.prediction.tokens_per_second:.3g} tok/s {describe_candidate(c, list(names))}"
            for c in choice.alternatives
        )
        notes = (
            f"planner: {describe_candidate(choice.best, list(names))} "
            f"(objective {choice.objective}: {choice.reason}); runner-ups: {runner_ups}; "
            f"{pricing_note(devices)}",
        )
        chosen = tuple(names[d] for d in choice.best.devices)
        return choice.best.plan, chosen, choice.best.prediction, notes
    table = table_for(spec.model_type)
    if not table.split and len(names) > 1:  # shares set by hand, no table to split with
        plan, kept = plan_unsplit(spec, weights)
        return plan, tuple(names[i] for i in kept), None, (table.why,)
    return single_stage(plan_tensor_parallel(spec, weights)), names, None, ()


def place(
    spec: ModelSpec,
    cluster: Members,
    holdings: Holdings,
    objective: ObjectiveChoice = "latency",
    queue: int = 0,
    draft: DraftCost | None = None,
) -> Placement:
    """Plan, rank order, transfers and prediction of one epoch (see the module's notes);
    ``queue``: requests running or waiting as it plans (the auto objective goes by it)."""
    plan, order, prediction, notes = plan_of(spec, cluster, objective, queue, draft)
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

        def plan_for(candidate: tuple[NodeId, ...]) -> PipelinePlan:
            if candidate == order:
                return planned
            return single_stage(plan_tensor_parallel(spec, [weight_of[n] for n in candidate]))

        order, plan = choose_rank_order(manifest, order, plan_for, holdings.held)
    transfers = plan_transfer(manifest, plan, order, holdings.held)
    return Placement(
        plan=plan, rank_order=order, transfers=transfers, prediction=prediction, notes=notes
    )
