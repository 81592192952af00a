"""One node of `exo-tp run` in this process: its device profile, its secret and API access,
then the node itself until SIGINT/SIGTERM (`exo_tp.node.node.Node`)."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from exo_tp.cli.connection_args import connection_limits
from exo_tp.cli.lab_args import lab_factor, lab_variables
from exo_tp.cli.logs import label_logs
from exo_tp.cli.security_args import api_access, node_secret
from exo_tp.frozen import replace
from exo_tp.security.addresses import is_loopback

if TYPE_CHECKING:
    from exo_tp.node.cluster.config import NodeConfig
    from exo_tp.node.options import NodeOptions
    from exo_tp.plan.devices import DeviceProfile
    from exo_tp.security.access import ApiAccess

log = logging.getLogger(__name__)


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


def _profile_now(options: NodeOptions, folders: Sequence[Path]) -> DeviceProfile | None:
    """This node's profile (see node_profile), scaled by its lab work factor, with the
    machine's memory as it is now rather than when it was measured."""
    from exo_tp.profile.system import memory

    profile = node_profile(options, folders)
    # The lab: this node's ranks get its work factor and cores (they inherit the environment)
    os.environ.update(lab_variables(options.lab))
    if profile is not None and options.lab is not None and not options.profile:
        from exo_tp.lab.factor import scaled_profile

        profile = scaled_profile(profile, lab_factor(options.lab))
    if profile is not None:  # memory as it is now, not when the profile was measured
        total, available = memory()
        profile = replace(profile, memory_total=total, memory_available=available)
    return profile


def _node_config(
    options: NodeOptions, host: str, bind: str, secret: str, access: ApiAccess
) -> NodeConfig:
    """The node's configuration from its options (one readable error for a bad --rdma)."""
    import mlx.core as mx

    from exo_tp.cli.launch import adapter_folder
    from exo_tp.errors import ExoTpError
    from exo_tp.node.cluster.config import NodeConfig
    from exo_tp.wire.ids import NodeId

    api_limits, cluster_limits = connection_limits(options.connections)
    rdma = {}
    for item in options.rdma:
        peer, _, device = item.partition("=")
        if not peer or not device:
            raise ExoTpError(f"--rdma {item!r}: expected PEER=DEVICE")
        rdma[peer] = device
    return NodeConfig(
        node_id=NodeId(options.node_id or default_node_id()),
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
        members=options.members,
        keep_alive=options.keep_alive,
        max_models=options.max_models,
        replicas=options.replicas,
        max_memory=options.max_memory,
    )


async def _serve(
    options: NodeOptions,
    host: str,
    bind: str,
    secret: str,
    access: ApiAccess,
    on_serving: Callable[[], None] | None = None,
) -> int:
    import zeroconf

    from exo_tp.api.web import web_routes
    from exo_tp.errors import ExoTpError
    from exo_tp.models.registry import resolve_model
    from exo_tp.node.member.weights import NodeWeights
    from exo_tp.node.node import Node

    folders = [(name, resolve_model(name)) for name in options.models]
    if not folders:
        log.info("no --model: this node receives its shard of the cluster's model from peers")
    profile = _profile_now(options, [folder for _, folder in folders])
    config = _node_config(options, host, bind, secret, access)
    label_logs(config.node_id)
    weights = NodeWeights(config.node_id, secret, folders)
    draft = options.serving.draft_model
    if draft is not None:  # offered as a draft: a conductor without it receives it whole
        weights.add_folder(draft, resolve_model(draft), draft=True)
    node = Node(config, weights, profile.summary() if profile else None)
    try:
        try:
            await node.start(web_routes())
        except OSError as error:
            raise ExoTpError(f"cannot serve on {config.host}:{config.api_port}: {error}") from None
        except zeroconf.Error as error:  # mDNS refusing to start (a name taken, ...)
            raise ExoTpError(f"node failed to start: {type(error).__name__}: {error}") from None
        except Exception as error:  # a bug: its traceback in the log, one line for the user
            log.exception("node failed to start")
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
