"""`exo-tp plan --profile ... --model A --model B` (or `--replicas`): every model as a group
of its own, placed on the memory the ones before it left, each as one group or replicas by
the objective (exo_tp.plan.groups, exo_tp.plan.replicas)."""

from __future__ import annotations

import argparse

from exo_tp.errors import ExoTpError, PlanError


def run_groups(args: argparse.Namespace, models: list[str]) -> int:
    from exo_tp.models.registry import resolve_model
    from exo_tp.plan import load_spec
    from exo_tp.plan.devices import read_profile
    from exo_tp.plan.groups import GroupModel, place_groups
    from exo_tp.plan.kv_width import KvShape
    from exo_tp.plan.of_model import profiled_cluster
    from exo_tp.plan.render_groups import render_groups

    if not args.profile:
        raise ExoTpError(
            "several models (or --replicas) are placed by each device's memory and speed: "
            "give one --profile per device"
        )
    if len(set(models)) != len(models):
        raise ExoTpError("a model is named twice: each --model is one group")
    profiles = [(p := read_profile(path), p.node_id or path.name) for path in args.profile]
    placed = []
    for model in models:
        spec = load_spec(resolve_model(model))
        cluster = profiled_cluster(spec, profiles, args.link_latency, args.link_bandwidth)
        placed.append(
            GroupModel(
                key=model, spec=spec, cluster=cluster, pinned=True, context_tokens=args.context
            )
        )
    kv = KvShape(bits=args.kv_bits, group_size=args.kv_group_size, streams=args.streams)
    try:
        plan = place_groups(placed, args.objective, args.queue, kv)
    except PlanError as error:
        raise ExoTpError(str(error)) from None
    names = [name for _, name in profiles]
    print(plan.model_dump_json() if args.json else render_groups(plan, names))
    return 0
