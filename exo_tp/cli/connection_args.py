"""`exo-tp run`'s connection flags: bounds on connections, so that no client can exhaust a
node (exo_tp.api.server_limits). The public API and the cluster listener have their own caps."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import TYPE_CHECKING

from exo_tp.cli.args import non_negative_float, positive_int

if TYPE_CHECKING:
    from exo_tp.api.server_limits import Limits
    from exo_tp.node.options import ConnectionOptions


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
    common = Limits(  # the caps below replaced
        header_timeout=flags.header_timeout,
        body_timeout=flags.body_timeout,
        keepalive_timeout=flags.keepalive_timeout,
        max_field_size=flags.max_header_size,
        max_line_size=flags.max_header_size,
    )
    api = replace(
        common,
        max_connections=flags.max_connections or default_api_connections(),
        max_per_address=flags.max_connections_per_address,
    )
    cluster = replace(
        common,
        max_connections=flags.cluster_max_connections or default_cluster_connections(),
        max_per_address=flags.cluster_max_connections_per_address,
    )
    return api, cluster
