"""`exo-tp launch`: one-shot generation on N local ranks with uneven shares."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from exo_tp.cli.args import (
    add_model_arg,
    add_overlap_arg,
    int_list,
    non_negative_float,
    positive_int,
    weight_list,
)
from exo_tp.cli.kv_args import add_kv_args, check_kv
from exo_tp.cli.lab_args import add_lab_args, lab_environments
from exo_tp.cli.speculative_args import (
    add_draft_model_arg,
    add_speculative_args,
    speculative_options,
)
from exo_tp.errors import ExoTpError

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from exo_tp.plan import ModelSpec
    from exo_tp.plan.pipeline import PipelinePlan


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch", help="generate once on N local ranks (tensor parallel)", description=__doc__
    )
    p.add_argument("--ranks", type=positive_int, default=2, help="number of local ranks")
    p.add_argument(
        "--weights",
        type=weight_list,
        help="relative speed of each rank, e.g. 5,3,2 (default: equal)",
    )
    add_model_arg(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=positive_int, default=256)
    p.add_argument("--temp", type=non_negative_float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=non_negative_float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        help="a stop string: generation ends where the text contains it (repeatable)",
    )
    p.add_argument(
        "--ignore-chat-template",
        action="store_true",
        help="use the raw prompt instead of the model's chat template",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16", "auto"),
        default="float32",
        help="compute dtype of float weights (default float32)",
    )
    p.add_argument(
        "--stages",
        help="pipeline: ranks per stage, e.g. 2,1 (consecutive ranks "
        "form a tensor-parallel group per stage)",
    )
    p.add_argument(
        "--stage-layers",
        help="pipeline: layers per stage, e.g. 18,12 (default: every stage takes the same "
        "time: layers follow each stage's summed weights, the last stage's LM head counted)",
    )
    add_overlap_arg(p)
    p.add_argument(
        "--join-timeout",
        type=non_negative_float,
        default=120.0,
        help="seconds to wait for all ranks to join the ring",
    )
    p.add_argument("--logits-out", help="save the prompt's logits (npy, rank 0) for checking")
    p.add_argument("--report-out", help="save generated token ids and stats (JSON)")
    p.add_argument(
        "--adapter-path",
        help="an mlx-lm LoRA adapter folder (e.g. from exo-tp "
        "finetune), applied to every rank's shard",
    )
    add_kv_args(p)
    add_speculative_args(p)
    add_draft_model_arg(p)
    add_lab_args(p, "rank", rebalance=False)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from exo_tp.models.registry import resolve_model
    from exo_tp.models.tokenizer import load_model_tokenizer
    from exo_tp.plan import load_spec
    from exo_tp.runtime.launcher import launch_local
    from exo_tp.wire.assignment import ServingOptions
    from exo_tp.wire.ids import RequestId
    from exo_tp.wire.runtime import GenerateRequest, OutOfVocabulary, SamplingParams

    weights = args.weights or [1.0] * args.ranks
    if len(weights) != args.ranks:
        raise ExoTpError(f"--weights has {len(weights)} values for {args.ranks} ranks")
    if args.top_p <= 0 or args.top_p > 1:
        raise ExoTpError("--top-p must be in (0, 1]")
    model_dir = resolve_model(args.model)
    spec = load_spec(model_dir)
    check_kv(spec, args)
    plan = _plan(spec, weights, args.stages, args.stage_layers)
    tokens = encode_prompt(
        load_model_tokenizer(model_dir), args.prompt, not args.ignore_chat_template
    )
    if len(tokens) + args.max_tokens > spec.context_length:
        raise ExoTpError(
            f"the prompt ({len(tokens)} tokens) and --max-tokens "
            f"{args.max_tokens} exceed the model's context of "
            f"{spec.context_length} tokens"
        )
    request = GenerateRequest(
        id=RequestId("launch"),
        tokens=tuple(tokens),
        sampling=SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p, seed=args.seed
        ),
        logits_out=str(Path(args.logits_out).resolve()) if args.logits_out else None,
        stop=tuple(args.stop),
    )
    try:
        request = request.fit(spec.vocab_size)
    except OutOfVocabulary as error:
        raise ExoTpError(f"the prompt does not fit the model: {error}") from None
    launch_local(
        str(model_dir),
        plan,
        request,
        args.dtype,
        args.report_out,
        join_timeout=args.join_timeout,
        adapter_path=adapter_folder(args.adapter_path),
        rank_env=lab_environments(args, plan.size),
        serving=ServingOptions(
            max_concurrency=1,
            prompt_cache_size=0,
            kv_bits=args.kv_bits,
            kv_group_size=args.kv_group_size,
            quantized_kv_start=args.quantized_kv_start,
            overlap=args.overlap,
            **speculative_options(args, model_dir),
        ),
    )
    return 0


def encode_prompt(
    tokenizer: TokenizerWrapper,
    prompt: str,
    use_chat_template: bool,
) -> list[int]:
    """Token ids the way `mlx_lm.generate` builds them (chat template unless told otherwise)."""
    if use_chat_template and tokenizer.has_chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt, add_special_tokens=True)


def adapter_folder(path: str | None) -> str | None:
    """The adapter's folder, checked here: a bad one is one line, not an error on every rank."""
    from exo_tp.shard.adapters import read_adapter

    if path is None:
        return None
    read_adapter(Path(path))
    return str(Path(path).resolve())


def _plan(
    spec: ModelSpec, weights: list[float], stages: str | None, stage_layers: str | None
) -> PipelinePlan:
    from exo_tp.plan.of_model import weighted_plan
    from exo_tp.plan.pipeline import plan_pipeline

    if stages is None:
        if stage_layers is not None:
            raise ExoTpError("--stage-layers needs --stages")
        plan, note = weighted_plan(spec, weights)
        if note is not None:  # planned as `exo-tp plan --weights` shows it
            log.info("%s", note)
        return plan
    sizes = int_list(stages, "--stages")
    if sum(sizes) != len(weights):
        raise ExoTpError(f"--stages {stages} adds up to {sum(sizes)} ranks, not {len(weights)}")
    groups, start = [], 0
    for size in sizes:
        groups.append(weights[start : start + size])
        start += size
    layers = int_list(stage_layers, "--stage-layers") if stage_layers else None
    return plan_pipeline(spec, groups, layers)
