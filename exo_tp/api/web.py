"""Serve the web UI (the files in web/) on the public port: the page at /, its assets at /ui/.

The wheel ships web/ as the package directory exo_tp/web (see setup.py); a source checkout or an
editable install serves the repository's web/ directly.

Only the UI's own files are served: the folder is listed once when the routes are built, and a
request names one of those files or gets a 404. Nothing in the request is ever joined to a path,
so encoded separators, absolute paths and symlinks leading out of the folder reach nothing.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

import exo_tp
from exo_tp.api.core.errors import ApiError

# Explicit types: ES modules must be served as JavaScript whatever the system's mimetypes say.
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
# Revalidate every time (ETag, 304) so a node that was upgraded never serves a stale mix.
NO_CACHE = {"Cache-Control": "no-cache"}


def web_dir() -> Path | None:
    """Where the UI files are: inside the installed package, else the checkout's web/."""
    package = Path(exo_tp.__file__).resolve().parent
    for candidate in (package / "web", package.parent / "web"):
        if (candidate / "index.html").is_file():
            return candidate
    return None


def ui_files(directory: Path) -> dict[str, Path]:
    """The files the UI may serve: regular files of a known kind directly in ``directory``
    whose real location (symlinks followed) is inside it."""
    root = directory.resolve()
    files = {}
    for entry in sorted(root.iterdir()):
        real = entry.resolve()
        if (
            entry.suffix in CONTENT_TYPES
            and not entry.name.startswith(".")
            and real.parent == root
            and real.is_file()
        ):
            files[entry.name] = real
    return files


def web_routes(directory: Path | None = None) -> web.RouteTableDef:
    directory = directory or web_dir()
    files = ui_files(directory) if directory is not None else {}
    routes = web.RouteTableDef()

    def serve(name: str) -> web.FileResponse:
        if directory is None:
            raise ApiError(
                404, "the web UI files are missing from this installation", code="not_found"
            )
        path = files.get(name)
        if path is None:
            raise ApiError(404, f"no such UI file: {name[:100]}", code="not_found")
        return web.FileResponse(
            path, headers={**NO_CACHE, "Content-Type": CONTENT_TYPES[path.suffix]}
        )

    @routes.get("/")
    async def index(request: web.Request) -> web.FileResponse:
        return serve("index.html")

    @routes.get("/ui/{name}")
    async def asset(request: web.Request) -> web.FileResponse:
        return serve(request.match_info["name"])

    return routes
