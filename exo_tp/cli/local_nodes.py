"""`exo-tp run --local-nodes N`: a whole cluster on this machine, each node a process
(`exo_tp.node.local_cluster`), measured once for all of them."""

from __future__ import annotations

import argparse
import secrets
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from exo_tp.cli.lab_args import local_node_labs, scaled_profiles
from exo_tp.cli.security_args import local_cluster_secret
from exo_tp.cli.serve_node import node_profile
from exo_tp.process.blas import blas_threads, usable_cores

if TYPE_CHECKING:
    from exo_tp.node.options import NodeLab, NodeOptions


def local_models(args: argparse.Namespace) -> list[str]:
    from exo_tp.models.registry import DEFAULT_MODEL

    return args.model or [DEFAULT_MODEL]  # the nodes share this machine's disk


def run_local_nodes(args: argparse.Namespace, options: NodeOptions) -> int:
    """Run ``args.local_nodes`` nodes here until interrupted, each with ``options`` but its own
    port, id, weight, profile and lab device."""
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
            members=len(profiles),
        )
        for i, profile in enumerate(profiles)
    ]
    return run_local_cluster(nodes, env)
