"""A stand-in Hugging Face hub on loopback: the file protocol `huggingface_hub` speaks (repo
info, file tree, resolve with Range), so downloads are tested without the real hub.

It counts what it serves (requests per client address, bytes per file), can require a token
for gated repos, and can drop a connection half-way through a file to test resuming.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web


@dataclass
class Repo:
    files: dict[str, bytes]
    sha: str = "0123456789abcdef0123456789abcdef01234567"
    gated_token: str | None = None  # requests without "Bearer <token>" get 403 GatedRepo

    @staticmethod
    def from_folder(folder: Path, **kwargs: object) -> Repo:
        return Repo(
            {f.name: f.read_bytes() for f in sorted(folder.iterdir()) if f.is_file()}, **kwargs
        )  # type: ignore[arg-type]


@dataclass
class StandInHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    # file name -> bytes after which the next GET of it is cut off (once)
    drop_after: dict[str, int] = field(default_factory=dict)
    # file name -> seconds each chunk of it waits (a slow download a test can kill half-way)
    slow: dict[str, float] = field(default_factory=dict)
    requests: list[tuple[str, str, str]] = field(default_factory=list)  # (address, method, path)
    served: Counter[str] = field(default_factory=Counter)  # file name -> body bytes sent
    tokens: list[str | None] = field(default_factory=list)
    ranges: list[tuple[str, str]] = field(default_factory=list)  # (file, Range header)
    url: str = ""

    def start(self) -> StandInHub:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        loop = asyncio.new_event_loop()
        started = threading.Event()

        async def serve() -> None:
            app = web.Application()
            app.router.add_get("/api/models/{org}/{name}/revision/{rev:.*}", self._info)
            app.router.add_get("/api/models/{org}/{name}/tree/{rev:[^/]+}{rest:.*}", self._tree)
            app.router.add_route("*", "/{org}/{name}/resolve/{rev}/{path:.*}", self._resolve)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.SockSite(runner, sock).start()
            started.set()

        self._loop = loop
        threading.Thread(
            target=lambda: (loop.run_until_complete(serve()), loop.run_forever()), daemon=True
        ).start()
        started.wait(10)
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)

    def clients(self) -> set[str]:
        return {address for address, _, _ in self.requests}

    def _repo(self, request: web.Request) -> Repo:
        self.requests.append((request.remote or "", request.method, request.path))
        auth = request.headers.get("Authorization")
        self.tokens.append(auth.removeprefix("Bearer ") if auth else None)
        repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
        repo = self.repos.get(repo_id)
        if repo is None:
            raise web.HTTPNotFound(
                headers={"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"}
            )
        if repo.gated_token is not None and auth != f"Bearer {repo.gated_token}":
            raise web.HTTPForbidden(
                headers={"X-Error-Code": "GatedRepo", "X-Error-Message": "Access restricted"}
            )
        rev = request.match_info["rev"]
        if rev not in ("main", repo.sha):
            raise web.HTTPNotFound(
                headers={"X-Error-Code": "RevisionNotFound", "X-Error-Message": "Invalid rev"}
            )
        return repo

    async def _info(self, request: web.Request) -> web.Response:
        repo = self._repo(request)
        repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
        siblings = [{"rfilename": name} for name in repo.files]
        return web.json_response(
            {
                "id": repo_id,
                "modelId": repo_id,
                "sha": repo.sha,
                "siblings": siblings,
                "private": False,
                "gated": repo.gated_token is not None,
                "tags": [],
            }
        )

    async def _tree(self, request: web.Request) -> web.Response:
        repo = self._repo(request)
        entries = []
        for name, data in repo.files.items():
            entry: dict[str, object] = {
                "type": "file",
                "path": name,
                "size": len(data),
                "oid": hashlib.sha1(data).hexdigest(),
            }
            if name.endswith(".safetensors"):
                entry["lfs"] = {
                    "oid": hashlib.sha256(data).hexdigest(),
                    "size": len(data),
                    "pointerSize": 134,
                }
            entries.append(entry)
        return web.json_response(entries)

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        repo = self._repo(request)
        name = request.match_info["path"]
        data = repo.files.get(name)
        if data is None:
            raise web.HTTPNotFound(headers={"X-Error-Code": "EntryNotFound"})
        lfs = name.endswith(".safetensors")
        etag = hashlib.sha256(data).hexdigest() if lfs else hashlib.sha1(data).hexdigest()
        headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
        if lfs:
            headers["X-Linked-Etag"] = f'"{etag}"'
            headers["X-Linked-Size"] = str(len(data))
        if request.method == "HEAD":
            headers["Content-Length"] = str(len(data))
            return web.Response(status=200, headers=headers)
        start = 0
        ranged = request.headers.get("Range", "")
        self.ranges.append((name, ranged))
        if ranged.startswith("bytes="):
            start = int(ranged.removeprefix("bytes=").split("-")[0] or 0)
        body = data[start:]
        response = web.StreamResponse(status=206 if start else 200, headers=headers)
        response.content_length = len(body)
        if start:
            response.headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        await response.prepare(request)
        cut = self.drop_after.pop(name, None)
        for offset in range(0, len(body), 1 << 16):
            chunk = body[offset : offset + (1 << 16)]
            if cut is not None and offset + len(chunk) > cut:
                await response.write(chunk[: max(cut - offset, 0)])
                self.served[name] += max(cut - offset, 0)
                assert request.transport is not None
                request.transport.close()  # a dropped connection, mid-file
                return response
            await response.write(chunk)
            self.served[name] += len(chunk)
            if name in self.slow:
                await asyncio.sleep(self.slow[name])
        await response.write_eof()
        return response
