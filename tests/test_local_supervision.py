"""The `--local-nodes` launcher's restart policy, on real (tiny) processes standing in for
nodes: a node that keeps dying is restarted a bounded number of times, then given up; one that
dies before it ever served stops the cluster with one readable line. The whole story with real
nodes (the survivor re-planned alone, the restarted node back in the plan) is in
test_security_local.py."""

from __future__ import annotations

import logging
import sys
import time

import pytest

from exo_tp.errors import ExoTpError
from exo_tp.node import local_cluster
from exo_tp.node.local_cluster import LocalNode, _watch

DIES = [sys.executable, "-c", "raise SystemExit(3)"]


def supervise(node: LocalNode, until: float) -> None:
    deadline = time.monotonic() + until
    while not node.given_up and time.monotonic() < deadline:
        _watch(node, {}, time.monotonic())
        time.sleep(0.05)


def test_a_node_that_keeps_dying_is_restarted_then_given_up(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(local_cluster, "RESTART_DELAYS", (0.1, 0.2, 0.3))
    node = LocalNode(0, 1, DIES)
    node.start({})
    node.ever_served = True  # it had served: a death is a fault, not a configuration error
    with caplog.at_level(logging.INFO, logger="exo_tp.node.local_cluster"):
        supervise(node, until=30)
    assert node.given_up and node.restarts == 3
    text = caplog.text
    assert text.count("exited with code 3") == 4
    assert "restarting local node 0 (port 1) (attempt 3 of 3)" in text
    assert "giving up after 3 restarts" in text


def test_a_node_that_never_served_stops_the_cluster() -> None:
    node = LocalNode(1, 1, DIES)
    node.start({})
    node.proc.wait()  # type: ignore[union-attr]
    with pytest.raises(ExoTpError, match="local node 1 .* exited with code 3 before it served"):
        _watch(node, {}, time.monotonic())
