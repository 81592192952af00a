"""`exo-tp run`: start a node (discovery, cluster formation, OpenAI-compatible API).

Shares follow each node's measured decode speed: a node uses its cached device profile (`exo-tp
bench`), or measures a quick one on first start (about 10 s), unless --weight sets its share by
hand (then nothing is measured) or --profile names a profile file.

One node with `--model` is enough: a node started without it holds no model, and receives its
shard of the model the cluster serves from its peers.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
import socket
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from exo_tp.api.server_limits import Limits
from exo_tp.cli.args import (
    int_list,
    json_object,
    non_negative_float,
    non_negative_int,
    positive_int,
    weight_list,
)
from exo_tp.cli.lab_args import (
    add_lab_args,
    lab_factor,
    lab_variables,
    local_node_labs,
    node_lab,
    rebalance_setting,
    scaled_profiles,
)
from exo_tp.cli.security_args import (
    add_security_args,
    api_access,
    local_cluster_secret,
    node_secret,
)
from exo_tp.frozen import replace
from exo_tp.process.blas import BUNDLED_BLAS, active_blas, blas_threads, usable_cores
from exo_tp.security.addresses import is_loopback

if TYPE_CHECKING:
    from exo_tp.api.defaults import GenerationDefaults
    from exo_tp.node.options import ConnectionOptions, NodeLab, NodeOptions
    from exo_tp.plan.devices import DeviceProfile
    from exo_tp.runtime.job import ServingOptions
    from exo_tp.security.access import ApiAccess

log = logging.getLogger(__name__)
# Prompts prefilled together where that is cheap (mlx-lm's BatchGenerator default).
BATCHED_PREFILL = 8


def add_parser(sub: argparse._SubParsersAction) -> None:
    # allow_abbrev=False: the removed --secret must not silently mean --secret-file
    p = sub.add_parser(
        "run", help="start a node (or a local cluster)", description=__doc__, allow_abbrev=False
    )
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
    serving.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        help="pipelines: keep one batch in flight across the stages instead of one "
        "micro-batch per stage (every stage busy under load)",
    )
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
    add_connection_args(p)
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
    add_lab_args(p, "node")
    add_generation_defaults(p)
    p.set_defaults(handler=run)


def add_connection_args(p: argparse.ArgumentParser) -> None:
    """Bounds on connections, so that no client can exhaust a node (see
    exo_tp.api.server_limits). The public API and the cluster listener have their own caps."""
    from exo_tp.api.server_limits import Limits

    default = Limits()
    group = p.add_argument_group("connections")
    group.add_argument(
        "--header-timeout",
        type=non_negative_float,
        default=default.header_timeout,
        help="seconds a new connection has to send its request's headers before it is "
        f"closed (default {default.header_timeout:g}; 0: no limit)",
    )
    group.add_argument(
        "--body-timeout",
        type=non_negative_float,
        default=default.body_timeout,
        help="seconds a request body has to arrive, else a 408 (default "
        f"{default.body_timeout:g}; 0: no limit)",
    )
    group.add_argument(
        "--keepalive-timeout",
        type=non_negative_float,
        default=default.keepalive_timeout,
        help=f"seconds an idle keep-alive connection stays open (default "
        f"{default.keepalive_timeout:g})",
    )
    group.add_argument(
        "--max-connections",
        type=positive_int,
        help="open connections to the public API, in total; more are refused at once with "
        "a 503 (default: a quarter of the open-files limit, at most 4096)",
    )
    group.add_argument(
        "--max-connections-per-address",
        type=positive_int,
        default=default.max_per_address,
        help="open connections to the public API from one client address; more are "
        f"refused with a 429 (default {default.max_per_address})",
    )
    group.add_argument(
        "--max-header-size",
        type=positive_int,
        default=default.max_field_size,
        help="bytes of the request line and of each header line; longer gets a JSON 400 "
        f"(default {default.max_field_size})",
    )
    group.add_argument(
        "--cluster-max-connections",
        type=positive_int,
        help="open connections to the cluster listener (--control-port: peers' control, "
        "status polls, weights, passed-on requests), in total (default: an eighth of the "
        "open-files limit, at most 1024)",
    )
    group.add_argument(
        "--cluster-max-connections-per-address",
        type=positive_int,
        default=CLUSTER_PER_ADDRESS,
        help="open connections to the cluster listener from one address (default "
        f"{CLUSTER_PER_ADDRESS})",
    )


CLUSTER_PER_ADDRESS = 128
CONNECTION_FLAGS = (
    "header_timeout",
    "body_timeout",
    "keepalive_timeout",
    "max_connections",
    "max_connections_per_address",
    "max_header_size",
    "cluster_max_connections",
    "cluster_max_connections_per_address",
)


def connection_options(args: argparse.Namespace) -> ConnectionOptions:
    from exo_tp.node.options import ConnectionOptions

    return ConnectionOptions(**{name: getattr(args, name) for name in CONNECTION_FLAGS})


def connection_limits(flags: ConnectionOptions) -> tuple[Limits, Limits]:
    """The public API's limits and the cluster listener's, after raising the open-files
    limit (the default caps follow it)."""
    from exo_tp.api.server_limits import (
        Limits,
        default_api_connections,
        default_cluster_connections,
        raise_fd_limit,
    )

    raise_fd_limit()
    common = {
        "header_timeout": flags.header_timeout,
        "body_timeout": flags.body_timeout,
        "keepalive_timeout": flags.keepalive_timeout,
        "max_field_size": flags.max_header_size,
        "max_line_size": flags.max_header_size,
    }
    api = Limits(
        max_connections=flags.max_connections or default_api_connections(),
        max_per_address=flags.max_connections_per_address,
        **common,
    )
    cluster = Limits(
        max_connections=flags.cluster_max_connections or default_cluster_connections(),
        max_per_address=flags.cluster_max_connections_per_address,
        **common,
    )
    return api, cluster


# GenerationDefaults' fields and the `exo-tp run` flags that set them (mlx_lm.server's names)
_FLAGS = {
    "temperature": "--temp",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "min_p": "--min-p",
    "max_tokens": "--max-tokens",
    "chat_template_args": "--chat-template-args",
}


def add_generation_defaults(p: argparse.ArgumentParser) -> None:
    """What a request that omits a field gets: mlx_lm.server's flags, names and defaults."""
    from exo_tp.api.defaults import GenerationDefaults

    default = GenerationDefaults()
    group = p.add_argument_group("generation defaults (for requests that omit the field)")
    group.add_argument(
        _FLAGS["temperature"],
        type=non_negative_float,
        default=default.temperature,
        help=f"sampling temperature (default: {default.temperature}, greedy)",
    )
    group.add_argument(
        _FLAGS["top_p"],
        type=non_negative_float,
        default=default.top_p,
        help=f"nucleus sampling top-p (default: {default.top_p}, off)",
    )
    group.add_argument(
        _FLAGS["top_k"],
        type=non_negative_int,
        default=default.top_k,
        help=f"top-k sampling (default: {default.top_k}, off)",
    )
    group.add_argument(
        _FLAGS["min_p"],
        type=non_negative_float,
        default=default.min_p,
        help=f"min-p sampling (default: {default.min_p}, off)",
    )
    group.add_argument(
        _FLAGS["max_tokens"],
        type=positive_int,
        default=default.max_tokens,
        help=f"maximum tokens to generate (default: {default.max_tokens})",
    )
    group.add_argument(
        _FLAGS["chat_template_args"],
        type=json_object,
        default=default.chat_template_args,
        help="JSON object of extra chat template arguments, e.g. '{\"enable_thinking\": false}'",
    )


def _flag_values(args: argparse.Namespace) -> dict[str, object]:
    """Each GenerationDefaults field's value from its flag."""
    return {
        field: getattr(args, flag.removeprefix("--").replace("-", "_"))
        for field, flag in _FLAGS.items()
    }


def generation_defaults(args: argparse.Namespace) -> GenerationDefaults:
    from pydantic import ValidationError

    from exo_tp.api.defaults import GenerationDefaults
    from exo_tp.errors import ExoTpError

    try:
        return GenerationDefaults.model_validate(_flag_values(args))
    except ValidationError as error:
        first = error.errors()[0]
        field = str(first["loc"][0])
        raise ExoTpError(f"{_FLAGS.get(field, field)}: {first['msg']}") from None


def default_host() -> str:
    import ifaddr

    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str) and not ip.ip.startswith(("127.", "169.254.")):
                return ip.ip
    return "127.0.0.1"


def default_node_id() -> str:
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())
    return f"{host[:40] or 'node'}-{secrets.token_hex(3)}"


def node_profile(options: NodeOptions, models: Sequence[Path] = ()) -> DeviceProfile | None:
    """The profile this node plans with: --profile, else the cached one, else a quick
    measurement (None with a manual --weight, or with --no-bench and nothing cached). A
    measured or cached one also gets the matrix shapes of the node's ``models`` it lacks
    (measured once, then cached with it), so the cluster prices and shares by them."""
    from exo_tp.plan.devices import read_profile
    from exo_tp.plan.spec import load_spec
    from exo_tp.profile.cache import cached_profile, device_profile, missing_shapes, profile_path
    from exo_tp.profile.shapes import model_shapes

    if options.profile:
        return read_profile(Path(options.profile))
    if options.weight > 0:
        return None
    cached = cached_profile(if_invalid="not using it" if options.no_bench else "measuring again")
    if options.no_bench:
        if cached is None:
            log.warning(
                "no cached device profile and --no-bench: this node counts as average speed"
            )
        return cached
    if cached is None:
        log.info(
            "no cached device profile in %s: measuring a quick one (about 10 s; "
            "`exo-tp bench` measures a full one)",
            profile_path(),
        )
        cached, _ = device_profile(quick=True)
        log.info(
            "measured: decode %.3g s/byte, prefill %.3g FLOP/s in %.1f s",
            cached.decode_seconds_per_byte,
            cached.prefill_flops,
            cached.duration_seconds,
        )
    profile = cached
    for folder in models:
        shapes = model_shapes(load_spec(folder))
        if missing := missing_shapes(profile, shapes):
            log.info(
                "measuring %d matrix shapes of %s (%s) once, for the planner; cached with the "
                "profile",
                len(missing),
                folder.name,
                shapes.dtype,
            )
            profile, _ = device_profile(quick=True, shapes=shapes)
    return profile


def run(args: argparse.Namespace) -> int:
    from exo_tp.security.access import read_api_key

    if args.profiles and not args.local_nodes:
        from exo_tp.errors import ExoTpError

        raise ExoTpError("--profiles is for --local-nodes; a single node takes --profile")
    options = node_options(args)  # a bad value is one readable error before anything starts
    if args.local_nodes:
        return _run_local(args, options)
    return serve_node(options, read_api_key(args.api_key, args.api_key_file))


def serve_node(
    options: NodeOptions, api_key: str | None, on_serving: Callable[[], None] | None = None
) -> int:
    """Run one node until SIGINT/SIGTERM; ``on_serving``: called once its API answers."""
    host = options.host or default_host()
    bind = options.bind or ("" if options.host else "0.0.0.0")
    listen = bind or host
    # Resolved before anything heavy starts: a node that would run open refuses at once.
    network = not (is_loopback(host) and is_loopback(listen))
    secret = node_secret(Path(options.secret_file) if options.secret_file else None, network)
    access = api_access(api_key, options.allowed_origins, listen)
    return asyncio.run(_serve(options, host, bind, secret.value, access, on_serving))


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
    from exo_tp.runtime.job import ServingOptions

    try:
        return ServingOptions(
            max_concurrency=args.max_concurrency,
            prefill_step_size=args.prefill_step_size,
            prefill_batch_size=args.prefill_batch_size or default_prefill_batch(),
            overlap=args.overlap,
            objective=args.objective,
            prompt_cache_size=args.prompt_cache_size,
            prompt_cache_bytes=args.prompt_cache_bytes,
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
    )


def options_from_flags(flags: Sequence[str]) -> NodeOptions:
    """`exo-tp run FLAGS...` as options, defaults included (for benches and tests that start
    nodes with `exo_tp.node.local_cluster.LocalCluster`). Only `run`'s own parser: the
    command line's (`exo_tp.cli.main`) imports this module."""
    parser = argparse.ArgumentParser(prog="exo-tp")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return node_options(parser.parse_args(["run", *flags]))


def local_models(args: argparse.Namespace) -> list[str]:
    from exo_tp.models.registry import DEFAULT_MODEL

    return args.model or [DEFAULT_MODEL]  # the nodes share this machine's disk


def _path_list(text: str) -> list[Path]:
    return [Path(part) for part in text.split(",") if part]


def _run_local(args: argparse.Namespace, options: NodeOptions) -> int:
    from exo_tp.errors import ExoTpError
    from exo_tp.frozen import replace
    from exo_tp.models.registry import resolve_model
    from exo_tp.plan.devices import read_profile
    from exo_tp.security.access import API_KEY_ENV, read_api_key
    from exo_tp.security.cluster_secret import SECRET_ENV

    if args.max_queue < 0:
        raise ExoTpError("--max-queue must be 0 or more")
    count = args.local_nodes
    if args.weights is not None and len(args.weights) != count:
        raise ExoTpError(f"--weights has {len(args.weights)} values for {count} local nodes")
    labs = local_node_labs(args, count)  # each node's own device (None: the lab is off)
    # Secrets reach the nodes through their environment, never their options or command lines.
    env = {SECRET_ENV: local_cluster_secret(args)}
    if (key := read_api_key(args.api_key, args.api_key_file)) is not None:
        env[API_KEY_ENV] = key
    # What every node shares: this machine's address, the models on its disk; the cluster
    # secret from the environment, any free control port, no RDMA.
    shared = replace(
        options,
        host="127.0.0.1",
        bind=None,
        control_port=0,
        secret_file=None,
        rdma=(),
        models=tuple(local_models(args)),
        weight=0.0,
    )
    if args.profiles:
        if len(args.profiles) != count:
            raise ExoTpError(f"--profiles has {len(args.profiles)} files for {count} local nodes")
        for path in args.profiles:
            read_profile(path)  # a bad file is one readable error here, not a dead node later
        profiles: list[str | None] = [str(path) for path in args.profiles]
        return _local_cluster(args, shared, profiles, labs, no_bench=False, env=env)
    with tempfile.TemporaryDirectory(prefix="exo-tp-local-") as tmp:
        # One measurement for the whole machine, before the nodes start: N nodes measuring at
        # once would share its cores and each see a fraction of its speed.
        # Measured with the BLAS threads each node's rank will have (a core each in the lab).
        threads = 1 if labs is not None else usable_cores() // count
        with blas_threads(threads):
            profile = (
                node_profile(options, [resolve_model(m) for m in shared.models])
                if args.profile or not args.weights
                else None
            )
        if profile is not None and labs is not None:  # the lab: each node its own device
            scaled = [str(p) for p in scaled_profiles(args, profile, count, tmp)]
            return _local_cluster(args, shared, list(scaled), labs, no_bench=False, env=env)
        path = None
        if profile is not None:
            path = Path(tmp) / "profile.json"
            path.write_text(profile.model_dump_json())
        no_bench = profile is None and not args.weights
        same = [str(path) if path else None] * count
        return _local_cluster(args, shared, same, labs, no_bench=no_bench, env=env)


def _local_cluster(
    args: argparse.Namespace,
    shared: NodeOptions,
    profiles: list[str | None],
    labs: list[NodeLab] | None,
    no_bench: bool,
    env: dict[str, str],
) -> int:
    from exo_tp.frozen import replace
    from exo_tp.node.local_cluster import run_local_cluster

    cluster = f"local-{secrets.token_hex(4)}"
    nodes = [
        replace(
            shared,
            api_port=args.api_port + i,
            node_id=f"local-{i}",
            cluster=cluster,
            weight=args.weights[i] if args.weights else 0.0,
            profile=profile,
            no_bench=no_bench,
            lab=labs[i] if labs else None,
        )
        for i, profile in enumerate(profiles)
    ]
    return run_local_cluster(nodes, env)


async def _serve(
    options: NodeOptions,
    host: str,
    bind: str,
    secret: str,
    access: ApiAccess,
    on_serving: Callable[[], None] | None = None,
) -> int:
    import mlx.core as mx

    from exo_tp.api.web import web_routes
    from exo_tp.cli.launch import adapter_folder
    from exo_tp.errors import ExoTpError
    from exo_tp.models.registry import resolve_model
    from exo_tp.node.config import NodeConfig
    from exo_tp.node.node import Node
    from exo_tp.node.weights import NodeWeights
    from exo_tp.profile.system import memory

    api_limits, cluster_limits = connection_limits(options.connections)
    folders = [(name, resolve_model(name)) for name in options.models]
    if not folders:
        log.info("no --model: this node receives its shard of the cluster's model from peers")
    profile = node_profile(options, [folder for _, folder in folders])
    # The lab: this node's ranks get its work factor and cores (they inherit the environment)
    os.environ.update(lab_variables(options.lab))
    if profile is not None and options.lab is not None and not options.profile:
        from exo_tp.lab.factor import scaled_profile

        profile = scaled_profile(profile, lab_factor(options.lab))
    if profile is not None:  # memory as it is now, not when the profile was measured
        total, available = memory()
        profile = replace(profile, memory_total=total, memory_available=available)
    rdma = {}
    for item in options.rdma:
        peer, _, device = item.partition("=")
        if not peer or not device:
            raise ExoTpError(f"--rdma {item!r}: expected PEER=DEVICE")
        rdma[peer] = device
    config = NodeConfig(
        node_id=options.node_id or default_node_id(),
        models=options.models,
        host=host,
        bind=bind,
        api_port=options.api_port,
        control_port=options.control_port,
        cluster=options.cluster,
        secret=secret,
        access=access,
        weight=options.weight,
        dtype=options.dtype,
        backend=options.backend,
        rdma=rdma,
        stages=options.stages,
        backends=tuple(
            b for b in ("ring", "jaccl", "mpi", "nccl") if mx.distributed.is_available(b)
        ),
        serving=options.serving,
        max_queue=options.max_queue,
        adapter_path=adapter_folder(options.adapter_path),
        stall_timeout=options.stall_timeout,
        defaults=options.defaults,
        rebalance=options.rebalance,
        rebalance_threshold=options.rebalance_threshold,
        api_limits=api_limits,
        cluster_limits=cluster_limits,
        strict_model_names=options.strict_model_names,
        models_dirs=tuple(Path(folder) for folder in options.models_dirs),
    )
    node = Node(
        config, NodeWeights(config.node_id, secret, folders), profile.summary() if profile else None
    )
    try:
        try:
            await node.start(web_routes())
        except OSError as error:
            raise ExoTpError(f"cannot serve on {config.host}:{config.api_port}: {error}") from None
        except Exception as error:  # e.g. mDNS refusing to start
            raise ExoTpError(f"node failed to start: {type(error).__name__}: {error}") from None
        if on_serving is not None:
            on_serving()
        stopped = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopped.set)
        await stopped.wait()
    finally:
        await node.stop()
    return 0
