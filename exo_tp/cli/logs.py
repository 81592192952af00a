"""How exo-tp's processes log: to stderr, a flood of one error summarised."""

from __future__ import annotations

import logging
import sys

from exo_tp import log_flood


def configure_logging(verbose: bool) -> None:
    """stderr logging of every exo-tp process that serves (`exo-tp`, a local node's child)."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        stream=sys.stderr,
        format="%(levelname)s %(message)s",
    )
    log_flood.install()  # a flood of one error (a failing accept()) is summarised, not copied
    if not verbose:
        # One line per HTTP request (huggingface_hub talks through httpx): noise, not news.
        for name in ("httpx", "httpx2", "httpcore", "huggingface_hub"):
            logging.getLogger(name).setLevel(logging.WARNING)


def label_logs(node_id: str) -> None:
    """A serving node's log lines carry the time and the node's id: an operator reading one
    node's log tells when each step of a failover took place, and a `--local-nodes` cluster
    writes every node's lines to one stream."""
    label = node_id.replace("%", "%%")
    formatter = logging.Formatter(f"%(asctime)s {label} %(levelname)s %(message)s")
    for handler in logging.getLogger().handlers:
        handler.setFormatter(formatter)
