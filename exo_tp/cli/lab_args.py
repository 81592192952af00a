"""Flags of the lab's emulated slow devices (exo_tp.lab.factor) and of live rebalancing, shared
by `exo-tp launch` and `exo-tp run`. The lab is off unless a work factor is given: then nothing
is wrapped and no rank is pinned."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from exo_tp.cli.args import non_negative_float
from exo_tp.errors import ExoTpError

if TYPE_CHECKING:
    from exo_tp.node.options import NodeLab
    from exo_tp.plan.devices import DeviceProfile

REBALANCE_THRESHOLD = 0.10


def add_lab_args(p: argparse.ArgumentParser, unit: str, rebalance: bool = True) -> None:
    lab = p.add_argument_group("lab (emulated slow devices)")
    lab.add_argument(
        "--work-factor",
        metavar="S,S,...",
        help=f"each {unit}'s work factor s >= 1, e.g. 1,2.5: every matmul of that {unit} does "
        f"s times the real work, and each {unit}'s rank is pinned to its own core",
    )
    lab.add_argument(
        "--work-factor-file",
        metavar="FILE,FILE,...",
        help=f"each {unit}'s work factor read from a file, re-read while serving (change "
        f"a device's speed at run time); pins each {unit}'s rank to its own core",
    )
    # a node's rank's cores, by hand (`exo-tp run --local-nodes` sets each node's in its
    # NodeOptions.lab instead)
    lab.add_argument("--lab-cpus", help=argparse.SUPPRESS)
    if not rebalance:
        return
    group = p.add_argument_group("rebalancing while serving")
    group.add_argument(
        "--rebalance",
        choices=("auto", "on", "off"),
        default="auto",
        help="leader: re-plan the shares when the ranks' live speeds drift. auto (default): "
        "on, except for --local-nodes without a work factor (unpinned local ranks share "
        "cores: their speed is the scheduler's); never over shares set by --weight",
    )
    group.add_argument(
        "--rebalance-threshold",
        type=non_negative_float,
        default=REBALANCE_THRESHOLD,
        help="re-plan when the slowest rank costs more than this fraction over a balanced "
        f"split, sustained (default {REBALANCE_THRESHOLD:g})",
    )


def _lists(args: argparse.Namespace, count: int) -> tuple[list[float | None], list[str | None]]:
    from exo_tp.lab.factor import parse_factors

    factors: list[float | None] = [None] * count
    if args.work_factor:
        factors = list(parse_factors(args.work_factor, count))
    files: list[str | None] = [None] * count
    if args.work_factor_file:
        parts = [f.strip() for f in args.work_factor_file.split(",")]
        if len(parts) != count or not all(parts):
            raise ExoTpError(f"--work-factor-file needs {count} comma-separated file(s)")
        files = list(parts)
    return factors, files


def _resolved(file: str | None) -> str | None:
    return str(Path(file).resolve()) if file else None


def lab_on(args: argparse.Namespace) -> bool:
    return bool(args.work_factor or args.work_factor_file)


def rebalance_setting(args: argparse.Namespace) -> str:
    """What --rebalance auto means here (on/off)."""
    if args.rebalance != "auto":
        return str(args.rebalance)
    return "on" if lab_on(args) or not args.local_nodes else "off"


def lab_environments(args: argparse.Namespace, count: int) -> list[dict[str, str]] | None:
    """Each rank's lab variables (None: lab off), rank i on core i (in turn)."""
    from exo_tp.lab.factor import core_for, lab_environment

    if not lab_on(args):
        return None
    factors, files = _lists(args, count)
    return [lab_environment(factors[i], files[i], core_for(i)) for i in range(count)]


def node_lab(args: argparse.Namespace) -> NodeLab | None:
    """A single node's lab (None: off), checked (a bad --work-factor is one readable error)."""
    from exo_tp.node.options import NodeLab

    if not lab_on(args):
        return None
    factors, files = _lists(args, 1)
    cpus = tuple(int(c) for c in args.lab_cpus.split(",")) if args.lab_cpus else None
    return NodeLab(work_factor=factors[0], work_factor_file=files[0], cpus=cpus)


def local_node_labs(args: argparse.Namespace, count: int) -> list[NodeLab] | None:
    """Each local node's lab (None: off): its factor or file, its rank on its own core."""
    from exo_tp.lab.factor import core_for
    from exo_tp.node.options import NodeLab

    if not lab_on(args):
        return None
    factors, files = _lists(args, count)
    return [
        NodeLab(
            work_factor=factors[i],
            work_factor_file=_resolved(files[i]),
            cpus=tuple(core_for(i)),
        )
        for i in range(count)
    ]


def lab_variables(lab: NodeLab | None) -> dict[str, str]:
    """A node's lab variables, for its rank processes (inherited: empty when off)."""
    from exo_tp.lab.factor import lab_environment

    if lab is None:
        return {}
    return lab_environment(lab.work_factor, lab.work_factor_file, lab.cpus)


def lab_factor(lab: NodeLab) -> float:
    """The factor a node starts with (its file's value now, if it reads one)."""
    from exo_tp.lab.factor import read_factor_file

    if lab.work_factor_file:
        return read_factor_file(Path(lab.work_factor_file))
    return lab.work_factor or 1.0


def node_factor(args: argparse.Namespace, index: int = 0, count: int = 1) -> float:
    """The factor local node ``index`` of ``count`` starts with."""
    from exo_tp.lab.factor import read_factor_file

    factors, files = _lists(args, count)
    file = files[index]
    if file:
        return read_factor_file(Path(file))
    return factors[index] or 1.0


def scaled_profiles(
    args: argparse.Namespace, profile: DeviceProfile, count: int, folder: str
) -> list[Path]:
    """The machine's profile (measured once, factor 1) as each local node's emulated device
    sees it, written into ``folder``: the planner sees the slow devices as real ones."""
    from exo_tp.lab.factor import scaled_profile

    paths = []
    for i in range(count):
        path = Path(folder) / f"profile-{i}.json"
        path.write_text(scaled_profile(profile, node_factor(args, i, count)).model_dump_json())
        paths.append(path)
    return paths
