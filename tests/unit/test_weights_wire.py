"""The weight routes in one process on loopback: signatures, typed refusals, progress."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from exo_tp.plan import load_spec, plan_tensor_parallel
from exo_tp.plan.pipeline import single_stage
from exo_tp.security.signing import control_headers
from exo_tp.weights.boxes import rank_boxes
from exo_tp.weights.build import manifest_for
from exo_tp.weights.client import TransferProgress, fetch_manifest, fetch_transfer
from exo_tp.weights.manifest import ModelManifest
from exo_tp.weights.server import MOUNT, ServedModel, WeightServer
from exo_tp.weights.store import ShardStore
from exo_tp.weights.transfer import Holding, TransferError, plan_transfer
from exo_tp.wire.weights import Piece, ReadRequest

SECRET = "wire-secret"


@asynccontextmanager
async def serving(server: WeightServer) -> AsyncIterator[str]:
    app = web.Application()
    app.add_subapp(MOUNT, server.app())
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}{MOUNT}"
    finally:
        await runner.cleanup()


@pytest.fixture
def q4(
    default_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, ModelManifest]:
    folder = default_models["smollm2-135m-q4"]
    return folder, manifest_for(folder, tmp_path_factory.getbasetemp() / "manifests")


async def post(
    session: aiohttp.ClientSession, url: str, body: bytes, secret: str | None = SECRET
) -> tuple[int, bytes]:
    path = url[url.index(MOUNT) :]
    headers = control_headers(secret, path, body) if secret else {}
    async with session.post(url, data=body, headers=headers) as response:
        return response.status, await response.read()


def test_requests_are_signed_typed_and_refused_clearly(
    tmp_path: Path, q4: tuple[Path, ModelManifest]
) -> None:
    folder, manifest = q4
    files, empty = WeightServer("A", SECRET), WeightServer("B", SECRET)
    files.serve(ServedModel(manifest, folder=folder))
    empty.serve(ServedModel(manifest, store=ShardStore(tmp_path / "store", manifest)))
    norm = manifest.tensor("model.norm.weight")

    def read(source: str, start: int = 0, stop: int = norm.length, model: str = "") -> bytes:
        return (
            ReadRequest(
                model=model or manifest.identity,
                source=source,  # type: ignore[arg-type]
                pieces=(Piece(tensor=norm.name, start=start, stop=stop),),
            )
            .model_dump_json()
            .encode()
        )

    async def run() -> None:
        async with serving(files) as a, serving(empty) as b, aiohttp.ClientSession() as s:
            status, data = await post(s, f"{a}/read", read("files"))
            assert status == 200 and len(data) == norm.nbytes
            assert (await post(s, f"{a}/read", read("files"), secret=None))[0] == 401
            assert (await post(s, f"{a}/read", read("files"), secret="wrong"))[0] == 401
            status, data = await post(s, f"{a}/read", b'{"model": 1}')
            assert status == 400 and "error" in json.loads(data)
            assert (await post(s, f"{a}/read", read("files", model="f" * 64)))[0] == 404
            status, data = await post(s, f"{a}/read", read("files", 0, 7))
            assert status == 409 and b"not whole digest blocks" in data
            status, data = await post(s, f"{b}/read", read("memory"))
            assert status == 409 and b"not in this store" in data  # never its holes
            status, data = await post(s, f"{b}/read", read("files"))
            assert status == 409 and b"no model files here" in data
            with pytest.raises(TransferError, match="401"):
                await fetch_manifest(s, a, "wrong", manifest.identity)
            assert await fetch_manifest(s, a, SECRET, manifest.identity) == manifest

            # a manifest answered by someone without the secret is not trusted
            async def unsigned_manifest(_: web.Request) -> web.Response:
                return web.Response(
                    body=manifest.model_dump_json(), content_type="application/json"
                )

            forged = web.Application()
            forged.add_routes([web.post(f"{MOUNT}/manifest", unsigned_manifest)])
            runner = web.AppRunner(forged, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            with pytest.raises(TransferError, match="not signed"):
                await fetch_manifest(
                    s,
                    f"http://127.0.0.1:{runner.addresses[0][1]}{MOUNT}",
                    SECRET,
                    manifest.identity,
                )
            await runner.cleanup()

    asyncio.run(run())


def test_fetch_reports_progress_and_skips_held_pieces(
    tmp_path: Path, q4: tuple[Path, ModelManifest]
) -> None:
    folder, manifest = q4
    plan = single_stage(plan_tensor_parallel(load_spec(folder), [5, 3, 2]))
    transfer = plan_transfer(manifest, plan, ["A", "B", "C"], [Holding(node="A", files=True)]).node(
        "B"
    )
    share = rank_boxes(manifest, plan, 1).nbytes(manifest)
    server = WeightServer("A", SECRET)
    server.serve(ServedModel(manifest, folder=folder))
    store = ShardStore(tmp_path / "store", manifest)
    seen: list[TransferProgress] = []

    async def run() -> None:
        async with serving(server) as a:
            report = await fetch_transfer(
                transfer,
                manifest,
                store,
                {"A": a},
                SECRET,
                on_progress=seen.append,
                piece_limit=256 << 10,
            )
            assert report.bytes_fetched == share == report.bytes_by_source["A"]
            again = await fetch_transfer(transfer, manifest, store, {"A": a}, SECRET)
            assert again.bytes_fetched == 0 and again.file_bytes == 0  # all held already

    asyncio.run(run())
    done = [p.bytes_done for p in seen]
    assert done == sorted(done) and len(seen) >= 2
    assert seen[-1].done and seen[-1].bytes_done == seen[-1].bytes_total == share
    assert seen[-1].eta_s == 0.0 and max(p.rate_bytes_s for p in seen) > 0
    assert seen[-1].line().startswith(f"B: {share / 1e6:.1f} / {share / 1e6:.1f} MB (100%)")
    assert server.stats().bytes_by_requester == {"B": share}
    store.require(rank_boxes(manifest, plan, 1))


def test_a_store_that_cannot_write_stops_the_fetch_with_a_clear_error(
    tmp_path: Path, q4: tuple[Path, ModelManifest]
) -> None:
    folder, manifest = q4
    plan = single_stage(plan_tensor_parallel(load_spec(folder), [1, 1]))
    transfer = plan_transfer(manifest, plan, ["A", "B"], [Holding(node="A", files=True)])
    server = WeightServer("A", SECRET)
    server.serve(ServedModel(manifest, folder=folder))
    store = ShardStore(tmp_path / "store", manifest)

    def full_disk(*args: object) -> list[int]:
        raise OSError(28, "No space left on device")

    store.write_piece = full_disk  # type: ignore[method-assign]

    async def run() -> None:
        async with serving(server) as a:
            with pytest.raises(TransferError, match="No space left"):
                await asyncio.wait_for(
                    fetch_transfer(transfer.node("B"), manifest, store, {"A": a}, SECRET), 60
                )

    asyncio.run(run())
