"""The `--local-nodes` launcher's restart policy, on real (tiny) processes standing in for
nodes: a node that keeps dying is restarted a bounded number of times, then given up; one that
dies before it ever served stops the cluster with one readable line. The whole story with real
nodes (the survivor re-planned alone, the restarted node back in the plan) is in
test_security_local.py."""

from __future__ import annotations

import logging
import subprocess
import sys

import psutil
import pytest

from exo_tp.errors import ExoTpError
from exo_tp.node.local_cluster import LocalCluster
from exo_tp.process.supervisor import Job

DIES = (sys.executable, "-c", "raise SystemExit(3)")
# Says Ready over the supervisor's link, as a node does once its API answers, then dies.
SERVES_THEN_DIES = (
    sys.executable,
    "-c",
    "from exo_tp.process.child import connect_supervisor\n"
    "from exo_tp.process.messages import Hello, Ready\n"
    "link = connect_supervisor()\n"
    "link.send(Hello(child=link.child))\n"
    "link.send(Ready())\n"
    "raise SystemExit(3)\n",
)


def test_a_node_that_keeps_dying_is_restarted_then_given_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with (
        LocalCluster(restart_delays=(0.1, 0.2, 0.3)) as cluster,
        caplog.at_level(logging.INFO, logger="exo_tp.node.local_cluster"),
    ):
        # it had served: a death is a fault, not a configuration error
        node = cluster.start(Job(name="local node 0 (port 1)", argv=SERVES_THEN_DIES))
        with pytest.raises(ExoTpError, match="every local node failed"):
            cluster.run()
    assert node.given_up and node.restarts == 3
    text = caplog.text
    assert text.count("exited with code 3") == 4
    assert "restarting local node 0 (port 1) (attempt 3 of 3)" in text
    assert "giving up after 3 restarts" in text


def test_a_node_that_never_served_stops_the_cluster() -> None:
    with LocalCluster() as cluster:
        cluster.start(Job(name="local node 1 (port 1)", argv=DIES))
        with pytest.raises(ExoTpError, match="local node 1 .* exited with code 3 before it served"):
            cluster.run()


# A supervisor that starts a child whose first act is to connect back (as every child of
# ours does), prints the child's pid, and dies at once, before it could accept anything.
SUPERVISES_THEN_DIES = (
    "import os, sys\n"
    "from exo_tp.process.supervisor import Job, Supervisor\n"
    "child = Supervisor(lambda c, e: None).start(Job(name='child', argv=("
    "sys.executable, '-c', "
    "'from exo_tp.process.child import connect_supervisor; connect_supervisor(timeout=120)')))\n"
    "print(child.pid, flush=True)\n"
    "os._exit(0)\n"
)


def test_a_child_whose_supervisor_died_exits_instead_of_waiting_for_it() -> None:
    """A rank started just before its node went down used to retry the node's closed port for
    its whole connect timeout (30 s), outliving the node (CI, bench/finetune.py --quick)."""
    done = subprocess.run(
        [sys.executable, "-c", SUPERVISES_THEN_DIES],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # the child writes there too: not a pipe this run waits on
        text=True,
        timeout=60,
    )
    child = psutil.Process(int(done.stdout))
    # The child still imports when its supervisor is gone; connect's 120 s would be the bound
    # without the orphan watch.
    gone, alive = psutil.wait_procs([child], timeout=20)
    for proc in alive:
        proc.kill()
    assert gone, "the orphaned child was still waiting for its supervisor after 20 s"
