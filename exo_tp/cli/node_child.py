"""One node of a cluster that exo-tp starts itself (`exo-tp run --local-nodes`, benches,
tests): ``python -m exo_tp.cli.node_child [--node-id ID]``, its `NodeOptions` (JSON) in
$EXO_TP_NODE_OPTIONS and its supervisor's link (`exo_tp.process.child`) in the environment.
It tells the supervisor Ready once its API answers, or why it failed; it stops on SIGTERM like
`exo-tp run`."""

from __future__ import annotations

import os
import sys

from exo_tp.api.server_limits import remember_fd_limit
from exo_tp.cli.logs import configure_logging
from exo_tp.cli.serve_node import serve_node
from exo_tp.node.options import NODE_OPTIONS_ENV, NodeOptions
from exo_tp.process.child import SupervisorLink, run_child
from exo_tp.process.lifecycle import exit_on_sigterm
from exo_tp.process.messages import Ready
from exo_tp.security.access import read_api_key


def main() -> None:
    remember_fd_limit()  # before mlx_lm's import lowers it (see raise_fd_limit), as `exo-tp`
    exit_on_sigterm()  # until the node's own handler takes over: `finally` blocks still run
    configure_logging(verbose=False)  # the same as `exo-tp run`'s: the flood filter included
    options = NodeOptions.model_validate_json(os.environ.pop(NODE_OPTIONS_ENV))
    # ``--node-id ID`` on the command line only labels the process for `ps`
    if sys.argv[1:] not in ([], ["--node-id", options.node_id]):
        sys.exit(f"exo-tp: error: {sys.argv[1:]} does not match the node's options")

    def serve(link: SupervisorLink) -> None:
        serve_node(options, read_api_key(None, None), on_serving=lambda: link.send(Ready()))

    try:
        run_child(serve)
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: the launcher says so
        sys.exit(130)


if __name__ == "__main__":
    main()
