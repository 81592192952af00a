"""`exo_tp.plan(...)`, the library's planner: the plan `exo-tp plan` prints, as a value (the CLI
calls this too).

With ``weights``: one uneven tensor-parallel group with those shares (`ShardPlan`,
what `exo-tp plan --weights ... --json` prints). With ``profiles`` (device profiles written by
`exo-tp bench`, as paths or values): the planner's choice among TP, pipeline and hybrid plans
(`Choice`, what `exo-tp plan --profile ... --json` prints). Pure: nothing is started.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from exo_tp.errors import ExoTpError

if TYPE_CHECKING:
    from exo_tp.plan.cluster import Cluster
    from exo_tp.plan.devices import DeviceProfile
    from exo_tp.plan.draft import DraftCost
    from exo_tp.plan.kv_width import KvShape
    from exo_tp.plan.pipeline import PipelinePlan
    from exo_tp.plan.search import Choice, ObjectiveChoice
    from exo_tp.plan.shard_plan import ShardPlan
    from exo_tp.plan.spec import ModelSpec


def plan(
    model: str,
    weights: Sequence[float] | None = None,
    profiles: Sequence[str | Path | DeviceProfile] | None = None,
    *,
    context: int | None = None,
    streams: int = 1,
    prompt_tokens: int = 512,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    objective: ObjectiveChoice = "latency",
    queue: int = 0,
    link_latency_us: float = 200.0,
    link_bandwidth_gbs: float = 1.0,
    alternatives: int = 5,
) -> ShardPlan | Choice:
    """The plan of ``model`` (a prepared name, a folder or a hub id) over ``weights`` (one
    uneven TP group; default two equal ranks) or measured ``profiles`` (the planner's choice).
    Links between profiled devices that were not measured are assumed at ``link_latency_us``
    and ``link_bandwidth_gbs``."""
    from exo_tp.models.registry import resolve_model
    from exo_tp.plan import load_spec

    if weights and profiles:
        raise ExoTpError("give weights or profiles, not both")
    spec = load_spec(resolve_model(model))
    if profiles:
        from exo_tp.plan.kv_width import KvShape

        named = [_profile(p) for p in profiles]
        cluster = profiled_cluster(spec, named, link_latency_us, link_bandwidth_gbs)
        kv = KvShape(bits=kv_bits, group_size=kv_group_size, streams=streams)
        return choose(spec, cluster, context, prompt_tokens, alternatives, objective, queue, kv)
    return split(spec, weights or [1.0, 1.0])


def split(spec: ModelSpec, weights: Sequence[float]) -> ShardPlan:
    """One uneven tensor-parallel group; a model without a table is one readable error."""
    from exo_tp.arch import mode_reason
    from exo_tp.plan import plan_tensor_parallel

    mode, why = mode_reason(spec.model_type)
    if mode != "tensor-parallel":
        raise ExoTpError(f"{spec.model_type} runs as {mode} ({why}): plan it from profiles")
    return plan_tensor_parallel(spec, list(weights))


def _profile(profile: str | Path | DeviceProfile) -> tuple[DeviceProfile, str]:
    """A profile and the name its device goes by (its node id, else its file's name)."""
    from exo_tp.plan.devices import read_profile

    if isinstance(profile, str | Path):
        read = read_profile(Path(profile))
        return read, read.node_id or Path(profile).name
    return profile, profile.node_id or f"device {id(profile):x}"


def profiled_cluster(
    spec: ModelSpec,
    profiles: Sequence[tuple[DeviceProfile, str]],
    link_latency_us: float,
    link_bandwidth_gbs: float,
) -> Cluster:
    """The devices of ``profiles`` (each with its name) and the links measured between them,
    the others assumed."""
    from exo_tp.plan.cluster import cluster_from_profiles
    from exo_tp.plan.cost import LinkCost

    assumed = LinkCost(
        latency=link_latency_us * 1e-6, bandwidth=link_bandwidth_gbs * 1e9, measured=False
    )
    return cluster_from_profiles(
        spec, [p for p, _ in profiles], assumed, names=[n for _, n in profiles]
    )


def choose(
    spec: ModelSpec,
    cluster: Cluster,
    context: int | None,
    prompt_tokens: int,
    alternatives: int,
    objective: ObjectiveChoice,
    queue: int,
    kv: KvShape,
    draft: DraftCost | None = None,
) -> Choice:
    """The planner's choice on ``cluster`` (exo_tp.plan.search)."""
    from exo_tp.plan.search import choose_plan

    return choose_plan(
        spec,
        cluster,
        context,
        prompt_tokens,
        alternatives,
        objective=objective,
        queue=queue,
        kv=kv,
        draft=draft,
    )


def weighted_plan(spec: ModelSpec, weights: Sequence[float]) -> tuple[PipelinePlan, str | None]:
    """The plan `exo-tp launch` and `exo_tp.load` run over ranks of these share weights: one
    uneven TP group where the model has a table; else what `exo-tp plan --weights` shows for
    it (stages of whole layers by the weights, or the whole model on the heaviest rank), with
    a line saying so (None for a TP group)."""
    from exo_tp.arch import mode_reason
    from exo_tp.plan.pipeline import plan_unsplit, single_stage
    from exo_tp.plan.render import describe

    mode, why = mode_reason(spec.model_type)
    if mode == "tensor-parallel":
        return single_stage(split(spec, weights)), None
    plan, _ = plan_unsplit(spec, list(weights))
    return plan, f"{mode} ({why}): {describe(plan)}"
