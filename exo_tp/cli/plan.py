"""`exo-tp plan`: print the shard plan for a model over weighted or profiled devices.

With --profile (one per device, written by `exo-tp bench --out` or `--json`), each device's
share follows its measured decode speed for the model's weight format, and the predicted decode
time per token is printed (links measured between the profiled nodes are used if present).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from exo_tp.cli.args import add_model_arg, weight_list
from exo_tp.errors import ExoTpError

log = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="print the shard plan", description=__doc__)
    add_model_arg(p)
    p.add_argument("--weights", type=weight_list,
                   help="relative speed of each device, e.g. 5,3,2 (default 1,1)")
    p.add_argument("--profile", type=Path, action="append",
                   help="a device profile from `exo-tp bench` (repeat: one per device)")
    p.add_argument("--json", action="store_true",
                   help="print the plan as JSON (with --profile: {plan, prediction})")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from exo_tp.models.registry import resolve_model
    from exo_tp.plan import load_spec, plan_tensor_parallel
    from exo_tp.plan.render import render_costs, render_plan

    if args.weights and args.profile:
        raise ExoTpError("give --weights or --profile, not both")
    spec = load_spec(resolve_model(args.model))
    if not args.profile:
        plan = plan_tensor_parallel(spec, args.weights or [1.0, 1.0])
        print(plan.model_dump_json(indent=2) if args.json
              else render_plan(plan) + "\n\n" + render_costs(plan))
        return 0

    from exo_tp.plan.cost import DEFAULT_LINK, predict_decode, weight_format, worst_link
    from exo_tp.plan.devices import read_profile

    profiles = [read_profile(path) for path in args.profile]
    dtype = weight_format(spec)
    plan = plan_tensor_parallel(spec, [p.decode_speed_for(dtype) for p in profiles])
    ids = {p.node_id for p in profiles if p.node_id}
    links = [x for p in profiles for x in p.links if x.a in ids and x.b in ids]
    for x in links:
        if not x.up:
            log.warning("link %s <-> %s is down: %s", x.a, x.b, x.error)
    prediction = predict_decode(plan, [p.seconds_per_byte(dtype) for p in profiles],
                                worst_link(links) or DEFAULT_LINK)
    if args.json:
        print(f'{{"plan": {plan.model_dump_json()}, "prediction": '
              f'{prediction.model_dump_json()}}}')
        return 0
    names = [f"{p.node_id or p.hostname or path.name}: {p.chip}"
             for p, path in zip(profiles, args.profile, strict=True)]
    print(render_plan(plan) + "\n\n" + render_costs(plan, prediction, names))
    return 0
