"""`exo-tp plan`: print the shard plan for a model over weighted devices."""

from __future__ import annotations

import argparse

from exo_tp.cli.args import add_model_arg, weight_list


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="print the shard plan", description=__doc__)
    add_model_arg(p)
    p.add_argument("--weights", type=weight_list, default=[1.0, 1.0],
                   help="relative speed of each device, e.g. 5,3,2")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from exo_tp.models.registry import resolve_model
    from exo_tp.plan import load_spec, plan_tensor_parallel
    from exo_tp.plan.render import render_plan

    plan = plan_tensor_parallel(load_spec(resolve_model(args.model)), args.weights)
    print(plan.model_dump_json(indent=2) if args.json else render_plan(plan))
    return 0
