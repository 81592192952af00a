"""A stranger on the LAN (run inside its own network namespace): forges the cluster's control
requests and an mDNS announcement, signed with keys that are not the cluster's secret, and
prints one JSON object: the HTTP status each forged request got.

    python tests/forge_control.py --host IP --cluster NAME --key "" --key WRONG \\
        --control IP:PORT [--control IP:PORT ...] [--announce-seconds S]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exo_tp import __version__  # noqa: E402
from exo_tp.node.cluster.discovery import Discovery  # noqa: E402
from exo_tp.security.signing import control_headers  # noqa: E402
from exo_tp.wire.announcement import Announcement

# What a stranger would send: release the workers, take over the ranks, read the status.
FORGED = [
    ("POST", "/control/release", {"epoch": 10**9}),
    ("POST", "/control/assign", {"assignment": {}, "leader": "intruder"}),
    ("POST", "/control/ports", {}),
    ("GET", "/control/status", None),
]


async def forge(controls: list[str], keys: list[str]) -> dict[str, int]:
    statuses = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        for control in controls:
            for key in keys:
                for method, path, payload in FORGED:
                    body = json.dumps(payload).encode() if payload is not None else b""
                    headers = {
                        "Content-Type": "application/json",
                        **control_headers(key, path, body),
                    }
                    async with session.request(
                        method, f"http://{control}{path}", data=body, headers=headers
                    ) as response:
                        statuses[f"{control} {key!r} {method} {path}"] = response.status
    return statuses


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", required=True)
    parser.add_argument("--cluster", required=True)
    parser.add_argument("--key", action="append", required=True)
    parser.add_argument("--control", action="append", required=True)
    parser.add_argument("--announce-seconds", type=float, default=0.0)
    args = parser.parse_args()
    discovery = None
    if args.announce_seconds > 0:  # claim membership, signed with the first key
        me = Announcement(
            node_id="intruder",
            version=__version__,
            cluster=args.cluster,
            host=args.host,
            api_port=8000,
            control_port=8001,
            started=time.time(),
        )
        discovery = Discovery(me, args.key[0], args.host, lambda a: None, lambda n: None)
        await discovery.start()
    statuses = await forge(args.control, args.key)
    if discovery is not None:
        await asyncio.sleep(args.announce_seconds)
        await discovery.stop()
    print(json.dumps(statuses), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
