"""`exo-tp` command line: one subcommand module per verb."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from exo_tp import __version__
from exo_tp.api.server_limits import remember_fd_limit
from exo_tp.cli import bench, finetune, launch, model, plan, run
from exo_tp.cli.logs import configure_logging
from exo_tp.errors import ExoTpError
from exo_tp.process.lifecycle import exit_on_sigterm

COMMANDS = (run, launch, finetune, plan, bench, model)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one readable line, not a usage dump
        self.exit(2, f"exo-tp: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="exo-tp", description=__doc__)
    parser.add_argument("--version", action="version", version=f"exo-tp {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    remember_fd_limit()  # before mlx_lm's import lowers it (see raise_fd_limit)
    args = build_parser().parse_args(argv)
    exit_on_sigterm()
    configure_logging(args.verbose)
    try:
        return int(args.handler(args) or 0)
    except ExoTpError as error:
        print(f"exo-tp: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("exo-tp: interrupted", file=sys.stderr)
        return 130
