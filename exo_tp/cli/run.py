"""`exo-tp run`: start a node (discovery, cluster formation, OpenAI-compatible API).

Shares follow each node's measured decode speed: a node uses its cached device profile (`exo-tp
bench`), or measures a quick one on first start (about 10 s), unless --weight sets its share by
hand (then nothing is measured) or --profile names a profile file.

One node with `--model` is enough: a node started without it holds no model, and receives its
shard of the model the cluster serves from its peers.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from exo_tp.cli.args import (
    add_overlap_arg,
    duration_arg,
    int_list,
    non_negative_float,
    positive_int,
    replicas_arg,
    size_arg,
    weight_list,
)
from exo_tp.cli.connection_args import add_connection_args, connection_options
from exo_tp.cli.generation_args import add_generation_defaults, generation_defaults
from exo_tp.cli.kv_args import add_kv_args, add_kv_memory_arg
from exo_tp.cli.lab_args import add_lab_args, node_lab, rebalance_setting
from exo_tp.cli.local_nodes import run_local_nodes
from exo_tp.cli.security_args import add_security_args
from exo_tp.cli.serve_node import serve_node
from exo_tp.cli.speculative_args import (
    add_draft_model_arg,
    add_speculative_args,
    node_speculative_options,
)
from exo_tp.process.blas import BUNDLED_BLAS, active_blas

if TYPE_CHECKING:
    from exo_tp.node.options import NodeOptions
    from exo_tp.wire.assignment import ServingOptions

# Prompts prefilled together where that is cheap (mlx-lm's BatchGenerator default).
BATCHED_PREFILL = 8


def add_parser(sub: argparse._SubParsersAction) -> None:
    # allow_abbrev=False: the removed --secret must not silently mean --secret-file
    p = sub.add_parser(
        "run", help="start a node (or a local cluster)", description=__doc__, allow_abbrev=False
    )
    _add_node_args(p)
    _add_serving_args(p)
    add_connection_args(p)
    _add_cluster_args(p)
    add_lab_args(p, "node")
    add_generation_defaults(p)
    p.set_defaults(handler=run)


def _add_node_args(p: argparse.ArgumentParser) -> None:
    """What this node is: its models, addresses, name, secret, share, profile and backend."""
    p.add_argument(
        "--model",
        action="append",
        metavar="MODEL",
        help="a model folder or name (smollm2-135m, smollm2-135m-q4) this node has; "
        "repeat it to offer several (the first is served first; a request "
        "naming another loads it). Without it the node holds no model and "
        "receives its shard from its peers (with --local-nodes: smollm2-135m)",
    )
    p.add_argument(
        "--host",
        help="address peers reach this node at (default: this machine's "
        "first non-loopback IPv4 address)",
    )
    p.add_argument(
        "--bind",
        help="address the API listens on (default: all interfaces when "
        "--host is detected, else --host)",
    )
    p.add_argument("--api-port", type=positive_int, default=8000)
    p.add_argument(
        "--control-port",
        type=int,
        default=0,
        help="port for cluster control (default: any free port, announced)",
    )
    p.add_argument("--node-id", help="unique node name (default: hostname + random suffix)")
    p.add_argument("--cluster", default="exo-tp", help="only peers with this name are joined")
    add_security_args(p)
    p.add_argument(
        "--weight",
        type=non_negative_float,
        default=0.0,
        help="this node's share weight, set by hand: nothing is measured (default: "
        "its measured decode speed)",
    )
    p.add_argument(
        "--profile",
        type=Path,
        help="device profile to use (from `exo-tp bench --out`) instead of the cached one",
    )
    p.add_argument(
        "--profiles",
        type=_path_list,
        help="with --local-nodes: each node's device profile, e.g. a.json,b.json "
        "(try the planner on devices this machine is not)",
    )
    p.add_argument(
        "--no-bench",
        action="store_true",
        help="never measure on start: the cached profile if any, else equal shares",
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16", "auto"), default="float32")
    p.add_argument(
        "--adapter-path",
        help="an mlx-lm LoRA adapter folder (e.g. from exo-tp finetune) applied to "
        "every rank's shard; the leader's is used, at the same path on every "
        "node",
    )
    p.add_argument(
        "--backend",
        choices=("auto", "ring", "jaccl"),
        default="auto",
        help="MLX distributed backend; auto takes jaccl when every pair of nodes "
        "has an RDMA link, else ring (TCP)",
    )
    p.add_argument(
        "--rdma",
        action="append",
        default=[],
        metavar="PEER=DEVICE",
        help="RDMA device towards a peer node (repeatable), for jaccl",
    )
    p.add_argument(
        "--stages",
        help="leader: force pipeline stages, ranks per stage in node "
        "order (leader first), e.g. 2,1",
    )


def _add_budget_args(serving: argparse._ArgumentGroup) -> None:
    """How much prompt a step may carry while streams decode (exo_tp.plan.step_budget)."""
    serving.add_argument(
        "--step-token-budget",
        type=positive_int,
        help="tokens one step may carry while streams decode: their tokens plus a chunk of "
        "a waiting prompt (default: a chunk costing about one decode step, from the plan's "
        "predicted decode and prefill speeds when the planner measured the devices; else "
        "--prefill-step-size chunks)",
    )
    serving.add_argument(
        "--prefill-gap",
        type=float,
        default=3.0,
        help="while a prompt prefills, a decoding stream's gap between tokens is at most about "
        "this many times its gap alone: the step budget's size, each chunk priced at its "
        "position (default 3; larger: prompts prefill faster, streams stutter more)",
    )


def _add_serving_args(p: argparse.ArgumentParser) -> None:
    """How the cluster batches, prefills, plans for, caches and watches requests."""
    serving = p.add_argument_group("serving")
    serving.add_argument(
        "--max-concurrency",
        type=positive_int,
        default=8,
        help="requests decoded together in one batch (default 8); more wait",
    )
    serving.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests waiting beyond the batch before new ones get a 429 (default 64)",
    )
    serving.add_argument(
        "--prefill-step-size",
        type=positive_int,
        default=512,
        help="prompt tokens processed per step between decode steps, so a "
        "long prompt never freezes running streams (default 512)",
    )
    _add_budget_args(serving)
    serving.add_argument(
        "--fused-steps",
        choices=("auto", "on", "off"),
        default="auto",
        help="run a step's decode rows and a waiting prompt's chunk in one forward pass "
        "(one stage, float KV cache, llama/Mistral/Qwen 2-3/SmolLM3 blocks): half the "
        "all-reduces of two passes, which pays on GPUs and over slow links; auto: on "
        "where every rank computes on a GPU (default auto)",
    )
    serving.add_argument(
        "--prefill-batch-size",
        type=positive_int,
        default=None,
        help="joining prompts prefilled together in one step (default: 1, one at a time and "
        "shortest first, on MLX's bundled CPU BLAS, where a step costs its token count; "
        f"{BATCHED_PREFILL} with OpenBLAS or on a GPU, where prompts prefill together cheaply)",
    )
    serving.add_argument(
        "--objective",
        choices=("latency", "throughput", "auto"),
        default="auto",
        help="what the planner optimises (measured profiles): one request's time per token, "
        "every stream's tokens together under load (stages overlap, layers follow stage "
        "speed), or auto: throughput when 2+ requests are running or waiting as it plans "
        "(default)",
    )
    add_overlap_arg(serving)
    add_kv_args(serving)
    add_kv_memory_arg(serving)
    add_speculative_args(serving)
    add_draft_model_arg(serving)
    serving.add_argument(
        "--prompt-cache-size",
        type=int,
        default=10,
        help="KV caches of recent requests kept for reuse by prefix "
        "(default 10; 0 disables the prompt cache)",
    )
    serving.add_argument(
        "--prompt-cache-bytes",
        type=int,
        help="byte budget of the prompt cache on the rank holding the most",
    )
    serving.add_argument(
        "--stall-timeout",
        type=non_negative_float,
        default=30.0,
        help="seconds a rank may make no progress before its epoch fails "
        "and the cluster re-plans without it (default 30)",
    )


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    """Model names, the picker's folders, and a local cluster of N nodes."""
    p.add_argument(
        "--keep-alive",
        type=duration_arg,
        help="how long a model loaded on demand stays loaded once idle (300, 5m, 1h; "
        "negative: for ever, the default); the --model ones stay; a request's keep_alive "
        "(Ollama's) overrides it",
    )
    p.add_argument(
        "--max-models",
        type=positive_int,
        default=3,
        help="models resident at once (default 3, as Ollama's per-GPU default); a request "
        "for one more lets the least recently used unpinned model go (the --model ones are "
        "pinned); models also go where the cluster's memory would not hold one more",
    )
    p.add_argument(
        "--max-memory",
        type=size_arg,
        help="memory of this machine the cluster may use for models (8GB, 512MB; default: "
        "what it has available when it starts): a team's Mac keeps the rest",
    )
    p.add_argument(
        "--replicas",
        type=replicas_arg,
        default=1,
        help="run the main model as N replicas over disjoint sets of nodes of about equal "
        "speed (more streams at once), or `auto`: the planner compares one group with 2, 3 "
        "... replicas for --objective and says why (`exo-tp plan --replicas` previews it); "
        "a router sends each request to one, a conversation back to the one holding its "
        "prefix (default 1: one group over every node)",
    )
    p.add_argument(
        "--strict-model-names",
        action="store_true",
        help="answer 404 to a request naming a model no node has; by default, while the "
        "cluster lists one model, such a request is served by it (as mlx_lm.server does)",
    )
    p.add_argument(
        "--models-dir",
        type=Path,
        action="append",
        default=[],
        help="a folder of model folders the web UI's model picker lists too (repeatable)",
    )
    p.add_argument(
        "--local-nodes", type=positive_int, help="run a whole cluster of N nodes on this machine"
    )
    p.add_argument("--weights", type=weight_list, help="with --local-nodes: each node's weight")


def run(args: argparse.Namespace) -> int:
    from exo_tp.security.access import read_api_key

    if args.profiles and not args.local_nodes:
        from exo_tp.errors import ExoTpError

        raise ExoTpError("--profiles is for --local-nodes; a single node takes --profile")
    options = node_options(args)  # a bad value is one readable error before anything starts
    if args.local_nodes:
        return run_local_nodes(args, options)
    return serve_node(options, read_api_key(args.api_key, args.api_key_file))


def default_prefill_batch() -> int:
    """Prompts prefilled together by default, from the BLAS this process multiplies with (the
    leader's choice is every rank's: they must batch alike). On MLX's bundled BLAS a step costs
    about its token count, so prompts join one at a time (the earliest first tokens); with a
    real BLAS or a GPU a batched prefill costs little more than one prompt's (mlx-lm's 8:
    docs/benchmarks.md, "First tokens")."""
    return 1 if active_blas() == BUNDLED_BLAS else BATCHED_PREFILL


def serving_options(args: argparse.Namespace) -> ServingOptions:
    from pydantic import ValidationError

    from exo_tp.errors import ExoTpError
    from exo_tp.wire.assignment import ServingOptions

    try:
        return ServingOptions(
            max_concurrency=args.max_concurrency,
            prefill_step_size=args.prefill_step_size,
            step_token_budget=args.step_token_budget,
            prefill_gap=args.prefill_gap,
            fused_steps=args.fused_steps,
            prefill_batch_size=args.prefill_batch_size or default_prefill_batch(),
            overlap=args.overlap,
            objective=args.objective,
            prompt_cache_size=args.prompt_cache_size,
            prompt_cache_bytes=args.prompt_cache_bytes,
            kv_bits=args.kv_bits,
            kv_group_size=args.kv_group_size,
            quantized_kv_start=args.quantized_kv_start,
            kv_cache_bytes=args.kv_cache_bytes,
            **node_speculative_options(args),
        )
    except ValidationError as error:
        first = error.errors()[0]
        raise ExoTpError(f"--{str(first['loc'][0]).replace('_', '-')}: {first['msg']}") from None


def node_options(args: argparse.Namespace) -> NodeOptions:
    """The parsed flags of one node, checked (a bad value is one readable error)."""
    from exo_tp.node.options import NodeOptions

    return NodeOptions(
        models=tuple(args.model or ()),
        host=args.host,
        bind=args.bind,
        api_port=args.api_port,
        control_port=args.control_port,
        node_id=args.node_id,
        cluster=args.cluster,
        secret_file=str(args.secret_file) if args.secret_file else None,
        allowed_origins=args.allowed_origins,
        weight=args.weight,
        profile=str(args.profile) if args.profile else None,
        no_bench=args.no_bench,
        dtype=args.dtype,
        backend=args.backend,
        rdma=tuple(args.rdma),
        stages=tuple(int_list(args.stages, "--stages")) if args.stages else (),
        adapter_path=args.adapter_path,
        serving=serving_options(args),
        max_queue=args.max_queue,
        stall_timeout=args.stall_timeout,
        defaults=generation_defaults(args),
        connections=connection_options(args),
        strict_model_names=args.strict_model_names,
        rebalance=rebalance_setting(args) == "on",
        rebalance_threshold=args.rebalance_threshold,
        lab=None if args.local_nodes else node_lab(args),
        models_dirs=tuple(str(folder) for folder in args.models_dir),
        keep_alive=None if args.keep_alive is None or args.keep_alive < 0 else args.keep_alive,
        max_models=args.max_models,
        replicas=args.replicas,
        max_memory=args.max_memory,
    )


def options_from_flags(flags: Sequence[str]) -> NodeOptions:
    """`exo-tp run FLAGS...` as options, defaults included (for benches and tests that start
    nodes with `exo_tp.node.local_cluster.LocalCluster`). Only `run`'s own parser: the
    command line's (`exo_tp.cli.main`) imports this module."""
    parser = argparse.ArgumentParser(prog="exo-tp")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return node_options(parser.parse_args(["run", *flags]))


def _path_list(text: str) -> list[Path]:
    return [Path(part) for part in text.split(",") if part]
