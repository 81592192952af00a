"""Weights move between peers: bring-up and re-plan from one copy vs a full copy on every node.

Two real clusters of `exo-tp run` nodes on loopback, one after the other in one run, shares
5/3/2, then a 4th node (weight 4) joins:

- one copy: only node n2 has the model folder; n0, n1 (and n3) start without ``--model``, each
  with its own empty $EXO_TP_HOME, and receive their shards from their peers;
- full copies: every node has the folder and reads its shard from its own disk (page cache).

For each: seconds from starting the nodes until the cluster serves (every node's /health says
ready and the plan spans every node), then from starting n3 until the 4-node plan serves.
For the one-copy cluster also the bytes the weight servers counted (the bytes moved), next to
the minimum: at bring-up every node without the files needs its whole share; after the join,
the least any rank order moves (every order tried here, from the shares held before), and what
re-reading every share would move. On one machine the "network" is loopback and the disk is
the page cache, so the times mostly show process start, planning and loading; the bytes are
exact.

    python bench/reshard.py [--model smollm2-135m] [--timeout 300] [--quick]

``--quick``: the same two clusters on a tiny random model with SmolLM2's tokenizer (32 MB,
bench/_common.py's ``tiny_model``, written to a temporary folder), of two nodes (n0 and n2,
shares 5/2) before n3 joins: a smoke run, its times and bytes not the default model's.

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import secrets
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from _common import MODEL_HELP, ROOT, env, model_arg, resolve

sys.path.insert(0, str(ROOT))

from exo_tp.cli.run import options_from_flags  # noqa: E402
from exo_tp.node.cluster.views import ClusterView, HealthView, PlanView  # noqa: E402
from exo_tp.node.cluster.weight_orders import WeightsStatus
from exo_tp.node.local_cluster import LocalCluster, node_job  # noqa: E402
from exo_tp.plan import plan_tensor_parallel  # noqa: E402
from exo_tp.plan.pipeline import PipelinePlan, single_stage  # noqa: E402
from exo_tp.transport.ports import port_is_free  # noqa: E402
from exo_tp.weights.boxes import rank_boxes  # noqa: E402
from exo_tp.weights.build import manifest_for  # noqa: E402
from exo_tp.weights.manifest import ModelManifest  # noqa: E402
from exo_tp.weights.transfer import Holding, bytes_to_move  # noqa: E402

WEIGHTS = {"n0": 5.0, "n1": 3.0, "n2": 2.0, "n3": 4.0}
HOLDER = "n2"  # the one node with the model folder in the one-copy cluster
FIRST = ["n0", "n1", "n2"]  # the nodes started together; then JOINER joins
# --quick: n1 left out, one node start fewer per cluster (each imports mlx_lm and transformers,
# and so does its rank); n0 still receives its shard from the holder, and n3 joins.
QUICK_FIRST = ["n0", "n2"]
JOINER = "n3"


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def free_ports(count: int) -> int:
    for base in range(31000, 40000, 37):
        if all(port_is_free(base + i) for i in range(count)):
            return base
    raise RuntimeError("no free ports")


class Nodes:
    def __init__(self, model: str, one_copy: bool, tmp: Path, timeout: float):
        self.model, self.one_copy, self.tmp, self.timeout = model, one_copy, tmp, timeout
        self.cluster, self.secret = f"reshard-{secrets.token_hex(3)}", secrets.token_hex(16)
        self.base = free_ports(len(WEIGHTS))
        self.processes = LocalCluster()  # the one `exo-tp run --local-nodes` uses

    def url(self, node: str) -> str:
        return f"http://127.0.0.1:{self.base + int(node[1:])}"

    def start(self, node: str) -> None:
        extra = {**env(), "EXO_TP_SECRET": self.secret}
        flags = ["--weight", str(WEIGHTS[node])]
        if not self.one_copy or node == HOLDER:
            flags += ["--model", self.model]
        else:
            home = self.tmp / f"home-{node}"
            home.mkdir()
            extra["EXO_TP_HOME"] = str(home)
        options = options_from_flags(
            [
                "--host",
                "127.0.0.1",
                "--api-port",
                str(self.base + int(node[1:])),
                "--node-id",
                node,
                "--cluster",
                self.cluster,
                "--stall-timeout",
                "300",
                *flags,
            ]
        )
        self.processes.start(node_job(int(node[1:]), options, extra, self.tmp / f"{node}.log"))

    def wait_ready(self, nodes: list[str]) -> float:
        started = time.monotonic()
        while time.monotonic() - started < self.timeout:
            try:
                ready = all(
                    HealthView.model_validate(get(f"{self.url(n)}/health")).state == "ready"
                    for n in nodes
                )
                plan = PlanView.model_validate(get(f"{self.url(nodes[0])}/v1/plan"))
                if ready and sorted(plan.nodes) == sorted(nodes):
                    return time.monotonic()
            except (OSError, ValueError):  # pydantic's ValidationError is a ValueError
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{nodes} not ready after {self.timeout} s; logs in {self.tmp}")

    def me(self, node: str) -> WeightsStatus:
        """The node's weights status, as it reports it in its own /v1/cluster."""
        view = ClusterView.model_validate(get(f"{self.url(node)}/v1/cluster"))
        weights = view.node(node).weights
        assert weights is not None, f"{node} reports no status"
        return weights.status

    def sent(self, nodes: list[str]) -> int:
        served = [self.me(n).served for n in nodes]
        return sum(sum(s.bytes_by_source.values()) for s in served if s)

    def fetch_seconds(self, nodes: list[str]) -> float:
        """The longest fetch of the latest epoch (the fetches run side by side)."""
        fetches = [self.me(n).fetch for n in nodes]
        return max((f.seconds for f in fetches if f), default=0.0)

    def plan(self) -> tuple[list[str], PipelinePlan]:
        view = PlanView.model_validate(get(f"{self.url('n0')}/v1/plan"))
        plan = view.pipeline()
        assert plan is not None, view
        return list(view.nodes), plan

    def stop(self) -> None:
        self.processes.close()


def fewest_bytes(
    manifest: ModelManifest, plan: PipelinePlan, nodes: list[str], holdings: dict[str, Holding]
) -> dict[tuple[str, ...], int]:
    """Bytes each rank order would move (shares follow the nodes), the served order's plan for
    the served order."""
    weight_of = dict(zip(nodes, plan.stages[0].tp.weights, strict=True))
    out = {}
    for order in itertools.permutations(nodes):
        candidate = (
            plan
            if list(order) == nodes
            else single_stage(plan_tensor_parallel(plan.spec, [weight_of[n] for n in order]))
        )
        out[order] = bytes_to_move(manifest, candidate, order, holdings)
    return out


def run_cluster(
    model: str, manifest: ModelManifest, one_copy: bool, timeout: float, first: list[str]
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="reshard-") as tmp:
        nodes = Nodes(model, one_copy, Path(tmp), timeout)
        try:
            started = time.monotonic()
            for node in first:
                nodes.start(node)
            up = nodes.wait_ready(first) - started
            result: dict[str, Any] = {"bring_up_s": round(up, 2)}
            order, plan = nodes.plan()
            holdings = {
                n: Holding(
                    node=n, files=not one_copy or n == HOLDER, store=rank_boxes(manifest, plan, r)
                )
                for r, n in enumerate(order)
            }
            if one_copy:
                moved = nodes.sent(first)
                result.update(
                    moved_bytes=moved,
                    fetch_s=round(nodes.fetch_seconds(first), 2),
                    minimum_bytes=sum(
                        rank_boxes(manifest, plan, r).nbytes(manifest)
                        for r, n in enumerate(order)
                        if n != HOLDER
                    ),
                )
            started = time.monotonic()
            nodes.start(JOINER)
            joined = [*first, JOINER]
            result["join_s"] = round(nodes.wait_ready(joined) - started, 2)
            if one_copy:
                result["join_moved_bytes"] = nodes.sent(joined) - moved
                result["join_fetch_s"] = round(nodes.fetch_seconds(joined), 2)
                new_order, new_plan = nodes.plan()
                costs = fewest_bytes(manifest, new_plan, new_order, holdings)
                result.update(
                    join_minimum_bytes=min(costs.values()),
                    join_appended_bytes=costs[(*order, JOINER)],
                    join_reread_bytes=sum(
                        rank_boxes(manifest, new_plan, r).nbytes(manifest)
                        for r, n in enumerate(new_order)
                        if n != HOLDER
                    ),
                    join_order=new_order,
                )
            return result
        finally:
            nodes.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help=MODEL_HELP)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run on a tiny model, two nodes first"
    )
    args = parser.parse_args()
    first = QUICK_FIRST if args.quick else FIRST
    # --quick: every node loads (and in the one-copy cluster receives) its shard, and the
    # 4-bit default model's 98 MB took seconds of each start on 2 cores.
    args.model = model_arg(args.model, args.quick)
    folder = resolve(args.model)
    manifest = manifest_for(folder)
    model_mb = manifest.total_bytes / 1e6
    shares = "/".join(f"{WEIGHTS[n]:g}" for n in first)
    print(
        f"{args.model}: {model_mb:.1f} MB of weights; shares {shares}, then a node of weight "
        f"{WEIGHTS[JOINER]:g} joins",
        flush=True,
    )
    one = run_cluster(str(folder), manifest, one_copy=True, timeout=args.timeout, first=first)
    print(
        f"one copy (only {HOLDER} has the files): up in {one['bring_up_s']} s, "
        f"{one['moved_bytes'] / 1e6:.1f} MB moved (minimum {one['minimum_bytes'] / 1e6:.1f}, "
        f"longest fetch {one['fetch_s']} s); join in {one['join_s']} s, "
        f"{one['join_moved_bytes'] / 1e6:.1f} MB moved (minimum "
        f"{one['join_minimum_bytes'] / 1e6:.1f}; appending the node "
        f"{one['join_appended_bytes'] / 1e6:.1f}; re-reading every share "
        f"{one['join_reread_bytes'] / 1e6:.1f})",
        flush=True,
    )
    full = run_cluster(str(folder), manifest, one_copy=False, timeout=args.timeout, first=first)
    print(
        f"full copies (every node has the files): up in {full['bring_up_s']} s; "
        f"join in {full['join_s']} s",
        flush=True,
    )
    print(
        json.dumps(
            {
                "model": args.model,
                "model_bytes": manifest.total_bytes,
                "one_copy": one,
                "full_copies": full,
                "bring_up_time_ratio": round(one["bring_up_s"] / full["bring_up_s"], 3),
                "join_time_ratio": round(one["join_s"] / full["join_s"], 3),
                "moved_vs_minimum": round(one["moved_bytes"] / one["minimum_bytes"], 4),
                "join_moved_vs_minimum": round(
                    one["join_moved_bytes"] / one["join_minimum_bytes"], 4
                ),
                "join_moved_vs_reread": round(
                    one["join_moved_bytes"] / one["join_reread_bytes"], 4
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
