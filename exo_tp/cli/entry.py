"""The `exo-tp` program's entry: choose the BLAS before anything loads MLX, then run the command
line (`exo_tp.cli.main`)."""

from __future__ import annotations

import sys

from exo_tp.errors import ExoTpError
from exo_tp.process.blas import preload_blas


def main() -> int:
    try:
        preload_blas()  # may re-execute this process, so before the command line's imports
    except ExoTpError as error:
        print(f"exo-tp: error: {error}", file=sys.stderr)
        return 2
    from exo_tp.cli.main import main as command_line

    return command_line()
