"""A stand-in node for the weight transport tests: the weight routes on loopback, plus test-only
routes to order a fetch, change serve options and read counters. Not a real node: no discovery,
no workers. Prints ``READY <port> <model identity or ->`` once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

import aiohttp
from aiohttp import web
from pydantic import ValidationError

from exo_tp.frozen import Frozen
from exo_tp.weights.build import manifest_for
from exo_tp.weights.client import fetch_manifest, fetch_transfer
from exo_tp.weights.server import MOUNT, ServedModel, ServeOptions, WeightServer
from exo_tp.weights.store import ShardStore
from exo_tp.weights.transfer import NodeTransfer, TransferError
from exo_tp.wire.errors import WireError


class FetchOrder(Frozen):
    model: str
    manifest_from: str  # a peer's node id
    transfer: NodeTransfer
    peers: dict[str, str]  # node id -> base URL of its weight routes


class Harness:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.server = WeightServer(args.node, args.secret)
        self.state = Path(args.state_dir)

    async def fetch(self, request: web.Request) -> web.Response:
        try:
            order = FetchOrder.model_validate_json(await request.read())
        except ValidationError as bad:
            return web.json_response(WireError(error=str(bad)).model_dump(), status=400)
        served = self.server.models.get(order.model)
        async with aiohttp.ClientSession() as session:
            if served is None:
                manifest = await fetch_manifest(
                    session, order.peers[order.manifest_from], self.args.secret, order.model
                )
                served = ServedModel(manifest, store=ShardStore(self.state / "store", manifest))
                self.server.serve(served)  # serves its boxes while it fetches more
            assert served.store is not None
            try:
                report = await fetch_transfer(
                    order.transfer,
                    served.manifest,
                    served.store,
                    order.peers,
                    self.args.secret,
                    session=session,
                    piece_limit=1 << 20,
                    request_bytes=4 << 20,
                )
            except TransferError as failed:
                return web.json_response(WireError(error=str(failed)).model_dump(), status=409)
        return web.json_response(report.model_dump(mode="json"))

    async def options(self, request: web.Request) -> web.Response:
        self.server.configure(ServeOptions.model_validate_json(await request.read()))
        return web.json_response(self.server.options.model_dump())

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.server.stats().model_dump())

    async def run(self) -> None:
        identity = "-"
        if self.args.model_folder:
            manifest = manifest_for(Path(self.args.model_folder), self.state / "manifests")
            self.server.serve(ServedModel(manifest, folder=Path(self.args.model_folder)))
            identity = manifest.identity
        app = web.Application()
        app.add_subapp(MOUNT, self.server.app())
        app.add_routes(
            [
                web.post("/test/fetch", self.fetch),
                web.post("/test/options", self.options),
                web.post("/test/stats", self.stats),
            ]
        )
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        print(f"READY {port} {identity}", flush=True)
        await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--node", required=True)
    parser.add_argument("--secret", required=True)
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--model-folder")
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format=f"{args.node} %(levelname)s %(name)s: %(message)s",
    )
    asyncio.run(Harness(args).run())


if __name__ == "__main__":
    main()
