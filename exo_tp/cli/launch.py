"""`exo-tp launch`: one-shot generation on N local ranks with uneven shares."""

from __future__ import annotations

import argparse

from exo_tp.cli.args import add_model_arg, non_negative_float, positive_int, weight_list
from exo_tp.errors import ExoTpError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch", help="generate once on N local ranks (tensor parallel)",
                       description=__doc__)
    p.add_argument("--ranks", type=positive_int, default=2, help="number of local ranks")
    p.add_argument("--weights", type=weight_list,
                   help="relative speed of each rank, e.g. 5,3,2 (default: equal)")
    add_model_arg(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=positive_int, default=256)
    p.add_argument("--temp", type=non_negative_float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=non_negative_float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="use the raw prompt instead of the model's chat template")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16", "auto"),
                   default="float32", help="compute dtype of float weights (default float32)")
    p.add_argument("--join-timeout", type=non_negative_float, default=120.0,
                   help="seconds to wait for all ranks to join the ring")
    p.add_argument("--logits-out", help="save the prompt's logits (npy, rank 0) for checking")
    p.add_argument("--report-out", help="save generated token ids and stats (JSON)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from exo_tp.models.registry import resolve_model
    from exo_tp.plan import load_spec, plan_tensor_parallel
    from exo_tp.runtime.job import LaunchJob, SamplingParams
    from exo_tp.runtime.launcher import launch_local

    weights = args.weights or [1.0] * args.ranks
    if len(weights) != args.ranks:
        raise ExoTpError(f"--weights has {len(weights)} values for {args.ranks} ranks")
    if args.top_p <= 0 or args.top_p > 1:
        raise ExoTpError("--top-p must be in (0, 1]")
    model_dir = resolve_model(args.model)
    plan = plan_tensor_parallel(load_spec(model_dir), weights)
    job = LaunchJob(
        model_dir=str(model_dir),
        plan=plan,
        prompt=args.prompt,
        use_chat_template=not args.ignore_chat_template,
        sampling=SamplingParams(max_tokens=args.max_tokens, temperature=args.temp,
                                top_p=args.top_p, seed=args.seed),
        dtype=args.dtype,
        logits_out=args.logits_out,
        report_out=args.report_out,
    )
    launch_local(job, join_timeout=args.join_timeout)
    return 0
