"""`exo-tp bench`: measure this device (and its links to peers) for the planner.

Prints a table, and with --json the profile as the last line of stdout. The device profile is
cached in the cache folder and reused until --refresh; links are measured on every run. With
peers, run the same command on every node (only --rank differs), started within --link-timeout
of each other, e.g. `exo-tp bench --peers 10.0.0.1,10.0.0.2,10.0.0.3 --rank 0`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from exo_tp.cli.args import address_list, non_negative_int, port_number, positive_float
from exo_tp.errors import ExoTpError
from exo_tp.frozen import replace

if TYPE_CHECKING:
    from exo_tp.profile.peers import Peers


def add_parser(sub: argparse._SubParsersAction) -> None:
    from exo_tp.profile.peers import DEFAULT_PORT_BASE

    p = sub.add_parser("bench", help="measure this device and its links", description=__doc__)
    p.add_argument("--quick", action="store_true", help="shorter measurement (about 10 s)")
    p.add_argument("--json", action="store_true", help="print the profile as JSON (last line)")
    p.add_argument("--refresh", action="store_true", help="measure again even if cached")
    p.add_argument("--out", type=Path, help="also write the profile (with links) to this file")
    p.add_argument(
        "--peers",
        type=address_list,
        help="addresses of all nodes in rank order, e.g. 10.0.0.1,10.0.0.2",
    )
    p.add_argument("--rank", type=non_negative_int, help="this node's index in --peers")
    p.add_argument(
        "--port-base",
        type=port_number,
        default=DEFAULT_PORT_BASE,
        help=f"first of the n*n ports the link measurements use (default {DEFAULT_PORT_BASE})",
    )
    p.add_argument(
        "--link-timeout",
        type=positive_float,
        default=10.0,
        help="seconds to wait for a peer, and for each link (default 10)",
    )
    p.add_argument(
        "--model",
        help="also time this model's matrices at slices of their split dimensions, so the "
        "planner prices each matrix of a split by its shape (cached with the profile)",
    )
    p.add_argument(
        "--work-factor",
        type=float,
        default=1.0,
        help="lab: measure as an emulated device this many times slower (every matmul does "
        "s times the work; cached apart from the real profile)",
    )
    p.set_defaults(handler=run)


def _peers(args: argparse.Namespace) -> Peers | None:
    from pydantic import ValidationError

    from exo_tp.profile.peers import Peers

    if args.peers is None:
        if args.rank is not None:
            raise ExoTpError("--rank needs --peers")
        return None
    if args.rank is None:
        raise ExoTpError("--peers needs --rank (this node's index in --peers)")
    try:
        return Peers(addresses=tuple(args.peers), rank=args.rank, port_base=args.port_base)
    except ValidationError as error:
        raise ExoTpError(error.errors()[0]["msg"].removeprefix("Value error, ")) from None


def run(args: argparse.Namespace) -> int:
    from exo_tp.lab.factor import check_factor
    from exo_tp.profile.cache import device_profile
    from exo_tp.profile.links import measure_links
    from exo_tp.profile.progress import Progress
    from exo_tp.profile.report import render_profile

    check_factor(args.work_factor, "--work-factor")
    peers = _peers(args)
    from exo_tp.profile.shapes import NO_SHAPES, model_shapes

    shapes = NO_SHAPES
    if args.model:
        from exo_tp.models.registry import resolve_model
        from exo_tp.plan.spec import load_spec

        shapes = model_shapes(load_spec(resolve_model(args.model)))
    with Progress() as progress:
        # Links first: nodes started together are still in step (device runs take unequal time).
        links = measure_links(peers, args.link_timeout, args.quick, progress) if peers else ()
        profile, cached = device_profile(
            refresh=args.refresh,
            quick=args.quick,
            progress=progress,
            work_factor=args.work_factor,
            shapes=shapes,
        )
    if peers:
        profile = replace(profile, node_id=peers.label(peers.rank), links=links)
    print(render_profile(profile, cached=cached))
    if args.out:
        try:
            args.out.write_text(profile.model_dump_json(indent=2) + "\n")
        except OSError as error:
            raise ExoTpError(f"cannot write {args.out}: {error.strerror or error}") from None
    if args.json:
        print(profile.model_dump_json())
    return 0
