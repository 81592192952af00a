"""`exo-tp plan`: print the shard plan for a model over weighted or profiled devices.

With --weights: one uneven TP group with those shares. With --profile (one per device, written
by `exo-tp bench --out` or `--json`): the planner compares uneven TP, pure pipeline, TP groups
chained as pipeline stages and plans that leave slow devices out, using each device's measured
scores and memory and the links measured between the profiled nodes (others are assumed), and
prints the fastest plan that fits, with its predicted decode time, and the runner-ups.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from exo_tp.cli.args import (
    non_negative_int,
    positive_float,
    positive_int,
    weight_list,
)
from exo_tp.cli.kv_args import add_kv_args, check_kv
from exo_tp.errors import ExoTpError

if TYPE_CHECKING:
    from exo_tp.plan.draft import DraftCost
    from exo_tp.plan.spec import ModelSpec


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="print the shard plan", description=__doc__)
    add_group_args(p)
    p.add_argument(
        "--weights",
        type=weight_list,
        help="relative speed of each device, e.g. 5,3,2 (default 1,1)",
    )
    p.add_argument(
        "--profile",
        type=Path,
        action="append",
        help="a device profile from `exo-tp bench` (repeat: one per device)",
    )
    p.add_argument(
        "--context",
        type=positive_int,
        help="tokens of context whose KV cache must fit (default: the model's)",
    )
    p.add_argument(
        "--streams",
        type=positive_int,
        default=1,
        help="streams holding a context at once, each --context long (default 1)",
    )
    add_kv_args(p)
    p.add_argument(
        "--prompt-tokens",
        type=positive_int,
        default=512,
        help="prompt length for the predicted prefill time (default 512)",
    )
    p.add_argument(
        "--link-latency",
        type=positive_float,
        default=200.0,
        help="µs of a small all_sum on links no profile measured (default 200)",
    )
    p.add_argument(
        "--link-bandwidth",
        type=positive_float,
        default=1.0,
        help="GB/s of links no profile measured (default 1)",
    )
    p.add_argument(
        "--objective",
        choices=("latency", "throughput", "auto"),
        default="latency",
        help="with --profile: what the plan is best at: one request's time per token "
        "(latency, the default), every stream's tokens together under load (throughput: the "
        "stages overlap, layers follow stage speed), or auto by --queue",
    )
    p.add_argument(
        "--queue",
        type=non_negative_int,
        default=0,
        help="requests running or waiting at once (auto plans for throughput from 2; "
        "throughput is priced at this many streams, at least 16)",
    )
    p.add_argument(
        "--draft-model",
        help="a draft model for speculative decoding: where it runs and its memory "
        "(whole beside the conductor, on plans of one tensor-parallel stage)",
    )
    p.add_argument(
        "--alternatives",
        type=non_negative_int,
        default=5,
        help="runner-up plans to show (default 5)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print JSON: the plan, or with --profile the planner's choice",
    )
    p.set_defaults(handler=run)


def add_group_args(p: argparse.ArgumentParser) -> None:
    """--model (repeatable: several groups) and --replicas (exo_tp.cli.plan_groups)."""
    p.add_argument(
        "--model",
        action="append",
        help="model folder or name (default: the default model); repeat to place several "
        "models at once, each a group of its own (needs --profile)",
    )
    p.add_argument(
        "--replicas",
        action="store_true",
        help="with --profile: compare one group with replicas over disjoint devices, by the "
        "objective (implied by several --model)",
    )


def run(args: argparse.Namespace) -> int:
    from exo_tp.models.registry import DEFAULT_MODEL, resolve_model
    from exo_tp.plan import load_spec

    if args.weights and args.profile:
        raise ExoTpError("give --weights or --profile, not both")
    models = args.model or [DEFAULT_MODEL]
    if len(models) > 1 or args.replicas:
        from exo_tp.cli.plan_groups import run_groups

        return run_groups(args, models)
    args.model = models[0]
    spec = load_spec(resolve_model(args.model))
    check_kv(spec, args)
    draft = _draft(args.draft_model)
    if draft is not None and args.kv_bits is not None:  # as ServingOptions.loads_draft says
        print(f"draft model {draft.name}: not loaded (a quantized KV cache does not speculate)")
        draft = None
    if args.profile:
        return _choose(args, spec, draft)

    from exo_tp.arch import mode_reason
    from exo_tp.plan import plan_tensor_parallel
    from exo_tp.plan.cost import rank_load
    from exo_tp.plan.human import size
    from exo_tp.plan.kv_width import rank_kv_bytes_per_token
    from exo_tp.plan.pipeline import single_stage
    from exo_tp.plan.render import render_plan
    from exo_tp.plan.shard_plan import Span

    mode, why = mode_reason(spec.model_type)
    if mode != "tensor-parallel":
        return _unsplit(args, spec, mode, why, draft)
    plan = plan_tensor_parallel(spec, args.weights or [1.0, 1.0])
    if args.json:
        print(plan.model_dump_json(indent=2))
        return 0
    every = Span(start=0, stop=spec.num_layers)
    held = [size(rank_load(spec, r, every, True, True).held_bytes) for r in plan.ranks]
    whole = single_stage(plan)
    kv = [
        size(1000 * rank_kv_bytes_per_token(whole, r, 4, args.kv_bits, args.kv_group_size))
        for r in range(plan.size)
    ]
    width = f"{args.kv_bits}-bit" if args.kv_bits else "float32"
    print(
        f"mode: {mode} ({why})\n"
        + render_plan(plan)
        + "\nweights held per rank: "
        + ", ".join(held)
        + f"\nKV cache per 1k tokens of context per rank ({width}): "
        + ", ".join(kv)
    )
    if spec.vision_bytes:
        print(
            f"vision tower: whole beside rank 0's shard (it embeds every image): "
            f"{size(spec.vision_bytes)} of weights"
        )
    if spec.mtp_bytes:
        print(
            f"MTP heads: whole beside every last-stage rank's shard (they draft with --mtp): "
            f"{size(spec.mtp_bytes)} of weights"
        )
    if draft is not None:
        print(
            f"draft model {draft.name}: whole beside rank 0 (the conductor): "
            f"{size(draft.weights)} of weights, {size(1000 * draft.kv_per_token)} of KV "
            "cache per 1k tokens of context"
        )
    return 0


def _draft(name: str | None) -> DraftCost | None:
    """The draft model's memory, for the plan (exo_tp.plan.draft)."""
    if name is None:
        return None
    from exo_tp.models.registry import resolve_model
    from exo_tp.plan import load_spec
    from exo_tp.plan.draft import draft_cost

    try:
        return draft_cost(load_spec(resolve_model(name)), name)
    except ValueError as error:
        raise ExoTpError(f"--draft-model {name}: cannot plan it: {error}") from None


def _unsplit(
    args: argparse.Namespace, spec: ModelSpec, mode: str, why: str, draft: DraftCost | None
) -> int:
    """A model without a tensor-parallel table over weighted devices: one stage per device,
    layers by speed (pipeline stages only), or the whole model on the fastest device."""
    from exo_tp.plan.cost import rank_load
    from exo_tp.plan.human import size
    from exo_tp.plan.pipeline import plan_unsplit
    from exo_tp.plan.render import describe

    weights = args.weights or [1.0, 1.0]
    plan, kept = plan_unsplit(spec, weights)
    if args.json:
        print(plan.model_dump_json(indent=2))
        return 0
    lines = [f"mode: {mode} ({why})", describe(plan)]
    if len(kept) == 1 and len(weights) > 1:
        lines.append(f"device {kept[0]} (the fastest) holds it; the others idle")
    for i, s in enumerate(plan.stages):
        load = rank_load(spec, s.tp.ranks[0], s.layers, i == 0, i == len(plan.stages) - 1)
        lines.append(f"stage {i}: layers {s.layers.start}-{s.layers.stop}, {size(load.held_bytes)}")
    if draft is not None:
        where = "the device holding the model" if len(plan.stages) == 1 else "the last stage"
        lines.append(f"draft model {draft.name}: whole beside {where}, {size(draft.weights)}")
    print("\n".join(lines))
    return 0


def _choose(args: argparse.Namespace, spec: ModelSpec, draft: DraftCost | None) -> int:
    from exo_tp.plan.devices import read_profile
    from exo_tp.plan.kv_width import KvShape
    from exo_tp.plan.of_model import choose, profiled_cluster
    from exo_tp.plan.render_choice import render_choice

    # A profile measured without --peers has no node id: name devices by their files then.
    profiles = [(p := read_profile(path), p.node_id or path.name) for path in args.profile]
    cluster = profiled_cluster(spec, profiles, args.link_latency, args.link_bandwidth)
    kv = KvShape(bits=args.kv_bits, group_size=args.kv_group_size, streams=args.streams)
    choice = choose(
        spec,
        cluster,
        args.context,
        args.prompt_tokens,
        args.alternatives,
        args.objective,
        args.queue,
        kv,
        draft,
    )
    print(choice.model_dump_json() if args.json else render_choice(choice, cluster))
    return 0
