"""One copy of the model is enough (issue #13): real nodes in network namespaces behind a bridge.

node-2 alone has the files (SmolLM2 q4 and float); node-0 (the leader) and node-1 start
without ``--model``, each with its own empty $EXO_TP_HOME. Shares 5/3/2:

1. the cluster answers exactly like single-device mlx-lm; node-2's server counted exactly each
   node's share of bytes sent to it; their stores hold exactly their shares, bit-equal to
   slicing the original file; neither ever had a model folder;
2. node-3 joins (weight 4, no q4 files): the bytes every server counted equal the minimum over
   every rank order (computed here from the old shares; appending node-3 would move more), and
   the stores are the original's slices;
3. a request for the float model gets a 503 with Retry-After and the cluster loads it from
   node-2 and node-3 (both have the float files) while node-2 flips a byte on the wire and
   node-3 is SIGKILLed mid-stream: the corrupt piece is refetched, node-3's pieces come from
   node-2, and the re-planned cluster answers like mlx-lm.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import secrets
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from cluster_helpers import Host, NamespaceLab, can_make_namespaces, http_json, wait_ready
from helpers import mlx_lm_reference
from openai import OpenAI
from safetensors import safe_open

from exo_tp.node.cluster.views import ClusterView, NodeWeightsView, PlanView
from exo_tp.node.cluster.weight_orders import FetchSummary
from exo_tp.plan import plan_tensor_parallel
from exo_tp.plan.pipeline import PipelinePlan, single_stage
from exo_tp.security.signing import control_headers
from exo_tp.weights.boxes import Boxes, rank_boxes, whole
from exo_tp.weights.build import manifest_for
from exo_tp.weights.manifest import ModelManifest
from exo_tp.weights.server import ServedStats, ServeOptions
from exo_tp.weights.transfer import Holding, bytes_to_move

pytestmark = pytest.mark.skipif(
    can_make_namespaces() is not None, reason=str(can_make_namespaces())
)

Q4, FLOAT = "smollm2-135m-q4", "smollm2-135m"
QUESTION = "What is the capital of France?"
TOKENS = 16
CONTROL_PORT = 8100  # fixed in every namespace: the test signs fault options to it


class Cluster:
    def __init__(self, lab: NamespaceLab, hosts: list[Host], tmp: Path):
        self.lab, self.hosts, self.tmp = lab, hosts, tmp
        self.name, self.secret = f"w-{lab.tag}", secrets.token_hex(16)

    def home(self, i: int) -> Path:
        return self.tmp / f"home-{i}"

    def start(self, i: int, *args: str, own_home: bool = True) -> None:
        env = {"EXO_TP_SECRET": self.secret, "EXO_TP_TEST_FAULTS": "1"}
        if own_home:
            self.home(i).mkdir()
            env["EXO_TP_HOME"] = str(self.home(i))
        self.lab.start_node(
            self.hosts[i],
            self.tmp,
            "--cluster",
            self.name,
            "--node-id",
            f"node-{i}",
            "--control-port",
            str(CONTROL_PORT),
            "--stall-timeout",
            "300",
            *args,
            env=env,
        )

    def url(self, i: int) -> str:
        return self.hosts[i].url

    def me(self, i: int) -> NodeWeightsView:
        """node-i's weights in its own /v1/cluster (its status as it reports it)."""
        view = ClusterView.model_validate(http_json(f"{self.url(i)}/v1/cluster")[1])
        weights = view.node(f"node-{i}").weights
        assert weights is not None
        return weights

    def served(self, i: int) -> ServedStats:
        served = self.me(i).status.served
        assert served is not None
        return served

    def fetches(self, i: int) -> list[FetchSummary]:
        status = self.me(i).status
        return [f for f in [status.fetch, *status.recent] if f]

    def fault(self, i: int, options: ServeOptions) -> None:
        path = "/weights/test-options"
        body = options.model_dump_json().encode()
        request = urllib.request.Request(
            f"http://{self.hosts[i].ip}:{CONTROL_PORT}{path}",
            data=body,
            headers={
                "Content-Type": "application/json",
                **control_headers(self.secret, path, body),
            },
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            assert response.status == 200

    def store(self, i: int, manifest: ModelManifest) -> Path:
        return self.home(i) / "stores" / manifest.identity[:32]

    def client(self, i: int) -> OpenAI:
        return OpenAI(base_url=f"{self.url(i)}/v1", api_key="unused", max_retries=0, timeout=120)

    def ask(self, i: int, model: str) -> str:
        answer = self.client(i).chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": QUESTION}],
            temperature=0,
            max_tokens=TOKENS,
        )
        return answer.choices[0].message.content or ""


def served_plan(url: str) -> tuple[list[str], PipelinePlan]:
    """The node per rank and the plan the cluster runs, from /v1/plan."""
    view = PlanView.model_validate(http_json(f"{url}/v1/plan")[1])
    plan = view.pipeline()
    assert plan is not None, view
    return list(view.nodes), plan


def assert_store_is_the_file(
    store: Path, folder: Path, manifest: ModelManifest, boxes: Boxes
) -> None:
    """Every byte of ``boxes`` in the store equals slicing the original file (safetensors)."""
    with (
        safe_open(str(store / "model.safetensors"), framework="np") as ours,
        safe_open(str(folder / "model.safetensors"), framework="np") as original,
    ):
        for name, a, b in boxes.pieces():
            index = (slice(None),) * manifest.tensor(name).axis + (slice(a, b),)
            got = np.ascontiguousarray(ours.get_slice(name)[index]).tobytes()
            assert got == np.ascontiguousarray(original.get_slice(name)[index]).tobytes(), name


def sent(stats: ServedStats) -> int:
    return sum(stats.bytes_by_source.values())


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, default_models: dict[str, Path]
) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("weights-netns")
    lab = NamespaceLab()
    lab.up()
    try:
        running = Cluster(lab, [lab.add_host() for _ in range(4)], tmp)
        running.start(2, "--weight", "2", "--model", Q4, "--model", FLOAT, own_home=False)
        running.start(0, "--weight", "5")
        running.start(1, "--weight", "3")
        wait_ready([running.url(i) for i in range(3)], nodes=3, timeout=240)
        yield running
    finally:
        lab.down()


@pytest.fixture(scope="module")
def q4(default_models: dict[str, Path]) -> ModelManifest:
    return manifest_for(default_models[Q4])


@pytest.fixture(scope="module")
def references(default_models: dict[str, Path]) -> dict[str, str]:
    return {m: mlx_lm_reference(default_models[m], QUESTION, TOKENS).text for m in (Q4, FLOAT)}


def test_one_copy_serves_like_mlx_lm(
    cluster: Cluster, q4: ModelManifest, references: dict[str, str], default_models: dict[str, Path]
) -> None:
    assert cluster.ask(1, Q4) == references[Q4]
    nodes, plan = served_plan(cluster.url(0))
    assert sorted(nodes) == ["node-0", "node-1", "node-2"]
    source = cluster.served(2)
    extras = sum(f.size for f in q4.extra_files)
    shares = {}
    for i in (0, 1):
        share = rank_boxes(q4, plan, nodes.index(f"node-{i}"))
        shares[i] = share.nbytes(q4)
        assert source.bytes_by_requester[f"node-{i}"] == shares[i]  # counted by node-2
        weights = cluster.me(i)
        assert weights.holds == "store" and weights.held_bytes == shares[i]
        assert weights.fetch is not None and weights.fetch.progress is not None
        assert weights.fetch.progress.bytes_done == shares[i]
        assert_store_is_the_file(cluster.store(i, q4), default_models[Q4], q4, share)
        assert not (cluster.home(i) / "models").exists()  # no model folder, ever
        assert "files" not in cluster.served(i).bytes_by_source
        log = cluster.hosts[i].log.read_text()  # type: ignore[union-attr]
        assert re.search(rf"weights: node-{i}: [\d.]+ / [\d.]+ MB \(100%\), [\d.]+ MB/s, done", log)
    assert source.bytes_by_source == {"files": shares[0] + shares[1]}
    # config and tokenizer files, to node-0 and node-1 (from node-2, or node-0's store)
    assert sum(cluster.served(i).file_bytes for i in range(3)) == 2 * extras
    models = http_json(f"{cluster.url(0)}/v1/models")[1]["data"]
    assert {m["id"]: m["loaded"] for m in models} == {Q4: True, FLOAT: False}


def test_a_join_moves_the_fewest_bytes(
    cluster: Cluster, q4: ModelManifest, references: dict[str, str], default_models: dict[str, Path]
) -> None:
    old_nodes, old_plan = served_plan(cluster.url(0))
    holdings = {
        n: Holding(node=n, store=rank_boxes(q4, old_plan, r))
        for r, n in enumerate(old_nodes)
        if n != "node-2"
    }
    holdings["node-2"] = Holding(node="node-2", files=True)
    before = [sent(cluster.served(i)) for i in range(3)]
    # node-3 has the float model's files, not q4's
    cluster.start(3, "--weight", "4", "--model", str(default_models[FLOAT]))
    wait_ready([cluster.url(i) for i in range(4)], nodes=4, timeout=240)
    nodes, plan = served_plan(cluster.url(0))
    moved = sum(sent(cluster.served(i)) for i in range(4)) - sum(before)

    weight_of = dict(zip(nodes, plan.stages[0].tp.weights, strict=True))

    def plan_for(order: tuple[str, ...]) -> PipelinePlan:
        if list(order) == nodes:
            return plan
        return single_stage(plan_tensor_parallel(plan.spec, [weight_of[n] for n in order]))

    costs = {o: bytes_to_move(q4, plan_for(o), o, holdings) for o in itertools.permutations(nodes)}
    assert moved == costs[tuple(nodes)] == min(costs.values())
    appended = (*old_nodes, "node-3")
    assert moved < costs[appended]  # the rank order matters: node-3 is not simply appended
    assert moved < sum(
        rank_boxes(q4, plan, r).nbytes(q4) for r, n in enumerate(nodes) if n != "node-2"
    )  # less than every node reading its share again
    print(
        f"join: {moved / 1e6:.1f} MB moved; appending node-3 would move "
        f"{costs[appended] / 1e6:.1f} MB"
    )
    for rank, node in enumerate(nodes):
        if node != "node-2":
            i = int(node.split("-")[1])
            assert_store_is_the_file(
                cluster.store(i, q4), default_models[Q4], q4, rank_boxes(q4, plan, rank)
            )
    assert cluster.ask(3, Q4) == references[Q4]


def test_another_model_loads_through_a_flipped_byte_and_a_killed_source(
    cluster: Cluster, references: dict[str, str], default_models: dict[str, Path]
) -> None:
    assert cluster.hosts[3].proc is not None, "runs after the join"
    cluster.fault(2, ServeOptions(corrupt_chunks=1))
    cluster.fault(3, ServeOptions(chunk_bytes=64 << 10, chunk_delay_s=0.05))
    # The served model let go first, so that the other one becomes the cluster's main model
    # (not a second one resident beside it: tests/cluster/test_resident_models.py).
    status, _ = http_json(f"{cluster.url(0)}/v1/models/unload", {"model": Q4})
    assert status == 200
    request = urllib.request.Request(
        f"{cluster.url(1)}/v1/chat/completions",
        data=json.dumps(
            {"model": FLOAT, "messages": [{"role": "user", "content": QUESTION}]}
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 503 and int(refused.value.headers["Retry-After"]) > 0
    assert json.loads(refused.value.read())["error"]["code"] == "model_loading"
    deadline = time.monotonic() + 120
    while not cluster.served(3).bytes_by_source.get("files"):  # node-3 streams, slowly
        assert time.monotonic() < deadline, "node-3 never served"
        time.sleep(0.2)
    host = cluster.hosts[3]
    assert host.proc is not None
    os.killpg(host.proc.pid, signal.SIGKILL)  # the node and its worker
    host.proc.wait()
    wait_ready([cluster.url(i) for i in range(3)], nodes=3, timeout=300)
    assert cluster.ask(0, FLOAT) == references[FLOAT]
    models = http_json(f"{cluster.url(2)}/v1/models")[1]["data"]
    assert {m["id"]: m["loaded"] for m in models} == {FLOAT: True, Q4: False}

    assert cluster.served(2).corrupted_chunks == 1
    fetches = [f for i in (0, 1) for f in cluster.fetches(i) if f.name == FLOAT]
    progress = [f.progress for f in fetches if f.progress]
    assert sum(p.corrupt_pieces for p in progress) >= 1  # caught, fetched again
    assert any("node-3" in p.failed_sources for p in progress)  # fell back to node-2
    manifest = manifest_for(default_models[FLOAT])
    nodes, plan = served_plan(cluster.url(0))
    for rank, node in enumerate(nodes):
        if node != "node-2":
            i = int(node.split("-")[1])
            assert_store_is_the_file(
                cluster.store(i, manifest),
                default_models[FLOAT],
                manifest,
                rank_boxes(manifest, plan, rank),
            )


def test_the_conductor_receives_the_draft_model_it_lacks(
    tmp_path: Path, default_models: dict[str, Path]
) -> None:
    """Speculative decoding with a draft model only the leader has: node-0 (the leader,
    `--draft-model smollm2-135m-q4`) and node-1 (nothing: its own empty home) as two pipeline
    stages, so node-1 is the conductor (the last stage's first rank). node-1 receives its
    stage's layers and the draft model whole into its store, and the answer (drafted by the
    4-bit model, verified through both stages) is single-device mlx-lm's for the float32
    model. The draft is offered as a draft only: /v1/models lists the float model alone, and
    a request naming the draft is answered by the float model, not a reason to load the
    draft as the served model."""
    reference = mlx_lm_reference(default_models[FLOAT], QUESTION, TOKENS)
    lab = NamespaceLab()
    lab.up()
    try:
        running = Cluster(lab, [lab.add_host() for _ in range(2)], tmp_path)
        stages = ("--stages", "1,1", "--no-bench")
        running.start(0, "--model", FLOAT, "--draft-model", Q4, *stages, own_home=False)
        running.start(1, *stages)
        wait_ready([running.url(i) for i in range(2)], nodes=2, timeout=240)
        answer = running.client(1).chat.completions.create(
            model=FLOAT,
            messages=[{"role": "user", "content": QUESTION}],
            temperature=0,
            max_tokens=TOKENS,
        )
        view = http_json(f"{running.url(0)}/v1/cluster")[1]
        fetched = {f.name: f for f in running.fetches(1)}
        listed = [m.id for m in running.client(1).models.list()]
        # offered only as a draft, not as a model of its own: a request naming it does not
        # make the cluster load it, the one model answers it (as any name, like mlx_lm.server)
        by_draft_name = running.client(1).chat.completions.create(
            model=Q4,
            messages=[{"role": "user", "content": QUESTION}],
            temperature=0,
            max_tokens=TOKENS,
        )
    finally:
        lab.down()
    assert listed == [FLOAT], listed
    assert by_draft_name.choices[0].message.content == reference.text
    assert answer.choices[0].message.content == reference.text
    assert view["serving"]["draft_node"] == "node-1", view["serving"]
    details = answer.usage.completion_tokens_details if answer.usage else None
    assert details is not None and (details.accepted_prediction_tokens or 0) > 0, answer.usage
    draft, q4 = fetched[Q4], manifest_for(default_models[Q4])
    assert draft.state == "done" and draft.retained_bytes == 0, draft
    assert draft.planned_bytes == draft.share_bytes == whole(q4).nbytes(q4), draft
