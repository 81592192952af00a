"""Weights move between real processes on loopback (tests/weights_harness.py stand-in nodes).

Node A has SmolLM2 (q4) on disk; B and C start empty and fetch their shares of a 5/3/2 plan,
every byte counted by the serving processes; D joins (4 nodes, rank order chosen to keep
bytes in place) and the bytes moved equal the planner's minimum; then E fetches the whole model
while B corrupts a chunk on the wire and C is SIGKILLed mid-stream. Every store is compared
with slicing the original file by the safetensors package.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from safetensors import safe_open

from exo_tp.plan import load_spec, plan_tensor_parallel
from exo_tp.plan.pipeline import PipelinePlan, single_stage
from exo_tp.weights.boxes import Boxes, rank_boxes
from exo_tp.weights.client import FetchReport, fetch_holding, fetch_manifest
from exo_tp.weights.manifest import ModelManifest
from exo_tp.weights.server import MOUNT, ServedStats, ServeOptions
from exo_tp.weights.transfer import Holding, bytes_to_move, choose_rank_order, plan_transfer

HARNESS = Path(__file__).resolve().parents[1] / "weights_harness.py"
SECRET = "weights-test-secret"
SPEEDS = {"A": 5.0, "B": 3.0, "C": 2.0, "D": 2.0}


class Node:
    def __init__(self, name: str, state: Path, folder: Path | None = None):
        self.name, self.state = name, state
        args = [
            sys.executable,
            str(HARNESS),
            "--node",
            name,
            "--secret",
            SECRET,
            "--state-dir",
            str(state),
        ]
        if folder is not None:
            args += ["--model-folder", str(folder)]
        self.process = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.process.stdout], [], [], 120)
        line = self.process.stdout.readline() if ready else ""
        assert line.startswith("READY"), f"{name} did not start: {line!r}"
        _, port, self.identity = line.split()
        self.url = f"http://127.0.0.1:{port}"
        self.weights = self.url + MOUNT

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


@pytest.fixture
def nodes(tmp_path: Path, default_models: dict[str, Path]) -> Iterator[dict[str, Node]]:
    started: dict[str, Node] = {}
    folder = default_models["smollm2-135m-q4"]
    try:
        started["A"] = Node("A", tmp_path / "A", folder)
        for name in "BCDE":
            started[name] = Node(name, tmp_path / name)
        yield started
    finally:
        for node in started.values():
            node.stop()


async def post(session: aiohttp.ClientSession, url: str, body: str) -> dict:
    async with session.post(url, data=body) as response:
        data = await response.json()
        assert response.status == 200, data
        return data


async def stats(session: aiohttp.ClientSession, node: Node) -> ServedStats:
    return ServedStats.model_validate(await post(session, f"{node.url}/test/stats", ""))


async def fetch(
    session: aiohttp.ClientSession, node: Node, model: str, transfer: object, peers: dict[str, Node]
) -> FetchReport:
    order = {
        "model": model,
        "manifest_from": "A",
        "transfer": transfer.model_dump(mode="json"),
        "peers": {n: p.weights for n, p in peers.items()},
    }
    return FetchReport.model_validate(
        await post(session, f"{node.url}/test/fetch", json.dumps(order))
    )


def assert_store_is_the_file(
    store: Path, folder: Path, manifest: ModelManifest, boxes: Boxes
) -> None:
    """Every byte of ``boxes`` in the store equals slicing the original file."""
    with (
        safe_open(str(store / "model.safetensors"), framework="np") as ours,
        safe_open(str(folder / "model.safetensors"), framework="np") as original,
    ):
        for name, a, b in boxes.pieces():
            axis = manifest.tensor(name).axis
            index = (slice(None),) * axis + (slice(a, b),)
            got = np.ascontiguousarray(ours.get_slice(name)[index]).tobytes()
            assert got == np.ascontiguousarray(original.get_slice(name)[index]).tobytes(), name


def served_delta(before: dict[str, ServedStats], after: dict[str, ServedStats]) -> int:
    return sum(
        sum(after[n].bytes_by_source.values()) - sum(before[n].bytes_by_source.values())
        for n in after
    )


async def scenario(nodes: dict[str, Node], folder: Path) -> None:
    a, b, c, d, e = (nodes[n] for n in "ABCDE")
    spec = load_spec(folder)
    async with aiohttp.ClientSession() as session:
        manifest = await fetch_manifest(session, a.weights, SECRET, a.identity)
        model = manifest.identity

        # 1. B and C fetch their shares of 5/3/2 from A, the only node with the files
        plan = single_stage(plan_tensor_parallel(spec, [5, 3, 2]))
        holdings = [Holding(node="A", files=True)]
        transfer = plan_transfer(manifest, plan, ["A", "B", "C"], holdings)
        peers = {n: nodes[n] for n in "ABC"}
        reports = await asyncio.gather(
            *(fetch(session, nodes[n], model, transfer.node(n), peers) for n in "BC")
        )
        served = {n: await stats(session, nodes[n]) for n in "ABC"}
        for rank, node, report in ((1, "B", reports[0]), (2, "C", reports[1])):
            share = rank_boxes(manifest, plan, rank).nbytes(manifest)
            assert served["A"].bytes_by_requester[node] == share  # counted by the server
            assert report.bytes_fetched == share and report.bytes_by_source == {"A": share}
            assert report.file_bytes == sum(f.size for f in manifest.extra_files)
        assert served["B"].bytes_by_source == {} and served["C"].bytes_by_source == {}
        for rank, node in ((1, "B"), (2, "C")):
            assert_store_is_the_file(
                nodes[node].state / "store", folder, manifest, rank_boxes(manifest, plan, rank)
            )

        # 2. D joins: the rank order keeps the most bytes in place; the moved bytes are the
        # planner's minimum, counted by every server.
        held = {n: await fetch_holding(session, nodes[n].weights, SECRET, model) for n in "ABCD"}
        assert held["A"].files and held["B"].store.ranges and not held["D"].store.ranges

        def plan_for(order: tuple[str, ...]) -> PipelinePlan:
            return single_stage(plan_tensor_parallel(spec, [SPEEDS[n] for n in order]))

        order, plan4 = choose_rank_order(manifest, ["D", "A", "B", "C"], plan_for, held.values())
        minimum = bytes_to_move(manifest, plan4, order, held)
        assert minimum <= bytes_to_move(
            manifest, plan_for(("D", "A", "B", "C")), ["D", "A", "B", "C"], held
        )
        transfer = plan_transfer(manifest, plan4, order, held.values())
        assert transfer.moved_bytes == minimum
        before = {n: await stats(session, nodes[n]) for n in "ABCD"}
        peers = {n: nodes[n] for n in "ABCD"}
        fetchers = [n for n in order if not held[n].files]
        reports = await asyncio.gather(
            *(fetch(session, nodes[n], model, transfer.node(n), peers) for n in fetchers)
        )
        after = {n: await stats(session, nodes[n]) for n in "ABCD"}
        assert sum(r.bytes_fetched for r in reports) == minimum
        assert served_delta(before, after) == minimum
        assert any(after[n].bytes_by_source.get("memory", 0) for n in "BC")  # stores served
        assert all("files" not in after[n].bytes_by_source for n in "BCD")
        for node in fetchers:
            share = rank_boxes(manifest, plan4, order.index(node))
            assert_store_is_the_file(nodes[node].state / "store", folder, manifest, share)

        # 3. E fetches the whole model, from the stores first: B flips a byte in its first
        # chunk, C is killed while it streams; both are fetched again from other peers.
        held = {n: await fetch_holding(session, nodes[n].weights, SECRET, model) for n in "ABCD"}
        whole = single_stage(plan_tensor_parallel(spec, [1]))
        transfer = plan_transfer(manifest, whole, ["E"], held.values(), chunk=1 << 20).node("E")
        assert {f.sources[0].node for f in transfer.fetches} >= {"B", "C"}
        await post(
            session,
            f"{b.url}/test/options",
            ServeOptions(corrupt_chunks=1, chunk_bytes=256 << 10).model_dump_json(),
        )
        await post(
            session,
            f"{c.url}/test/options",
            ServeOptions(chunk_delay_s=0.05, chunk_bytes=64 << 10).model_dump_json(),
        )
        task = asyncio.ensure_future(
            fetch(session, e, model, transfer, {n: nodes[n] for n in "ABCDE"})
        )
        while not (await stats(session, c)).bytes_by_requester.get("E"):
            await asyncio.sleep(0.02)
        os.kill(c.process.pid, signal.SIGKILL)
        report = await task
        assert report.corrupt_pieces >= 1 and report.failed_sources == ("C",)
        assert report.bytes_refetched > 0
        assert report.bytes_fetched == manifest.total_bytes
        assert (await stats(session, b)).corrupted_chunks == 1
        assert_store_is_the_file(
            e.state / "store", folder, manifest, rank_boxes(manifest, whole, 0)
        )


def test_shards_move_between_processes(
    nodes: dict[str, Node], default_models: dict[str, Path]
) -> None:
    asyncio.run(scenario(nodes, default_models["smollm2-135m-q4"]))
