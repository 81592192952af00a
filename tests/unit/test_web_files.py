"""The UI's file routes serve the UI's own files and nothing else on the disk.

Requests go over a raw socket so that no client library normalizes the path first: the server
must refuse encoded, double-encoded, absolute and symlinked escapes by itself.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from threading import Thread

import pytest
from aiohttp import web

from exo_tp.api.routes import json_errors
from exo_tp.api.web import web_dir, web_routes

SECRET = f"secret-{secrets.token_hex(8)}"


def raw_get(port: int, target: str) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


@contextmanager
def ui_server(directory: Path | None) -> Iterator[int]:
    loop = asyncio.new_event_loop()
    app = web.Application(middlewares=[json_errors])
    app.add_routes(web_routes(directory))
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    port = runner.addresses[0][1]
    thread = Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def escapes(outside: Path, ui: Path) -> list[str]:
    """Request targets that reach ``outside`` (a file outside the UI folder ``ui``)."""
    up = os.path.relpath(outside, ui)  # e.g. ../secret.html or ../../../tmp/x.html
    return [
        "/ui/" + up.replace("/", "%2f"),  # encoded separators
        "/ui/" + up.replace("/", "%2F").replace(".", "%2e"),
        "/ui/" + up.replace("/", "%252f"),  # double-encoded
        "/ui/" + str(outside).replace("/", "%2f"),  # absolute, encoded
        "/ui/" + str(outside).replace("/", "%252F"),
        "/ui/" + up,  # plain dot segments
        "/ui/%2e%2e/" + outside.name,
        "/" + up,
    ]


def test_escapes_from_a_ui_folder_get_404(tmp_path: Path) -> None:
    ui = tmp_path / "site" / "web"
    ui.mkdir(parents=True)
    (ui / "index.html").write_text("<html>ui</html>")
    (ui / "app.js").write_text("export const ui = 1;")
    outside = tmp_path / "site" / "secret.html"
    outside.write_text(SECRET)
    (ui / "linked.html").symlink_to(outside)  # a symlink leading out of the folder
    (ui / "inside.js").symlink_to(ui / "app.js")  # one staying inside is fine
    (ui / ".hidden.js").write_text(SECRET)
    with ui_server(ui) as port:
        assert raw_get(port, "/ui/app.js") == (200, b"export const ui = 1;")
        assert raw_get(port, "/ui/missing.js")[0] == 404
        assert raw_get(port, "/ui/inside.js") == (200, b"export const ui = 1;")
        for target in [
            *escapes(outside, ui),
            "/ui/linked.html",
            "/ui/.hidden.js",
            "/ui/secret.html",
            "/ui/web%2fapp.js",
        ]:
            status, body = raw_get(port, target)
            assert status == 404, (target, status, body[:200])
            assert SECRET.encode() not in body, target


def test_packaged_ui_folder_serves_no_other_file() -> None:
    """The shape the attack took against a node: /ui/..%2f..%2f..%2ftmp%2fx.html."""
    ui = web_dir()
    if ui is None:
        pytest.skip("no web UI in this installation")
    outside = Path("/tmp") / f"exo-tp-escape-{secrets.token_hex(4)}.html"
    outside.write_text(SECRET)
    try:
        with ui_server(None) as port:
            assert raw_get(port, "/")[0] == 200
            for target in escapes(outside, ui):
                status, body = raw_get(port, target)
                assert status == 404, (target, status)
                assert SECRET.encode() not in body, target
    finally:
        outside.unlink()
