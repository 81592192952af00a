"""Serve the web UI (the files in web/) on the public port: the page at /, its assets at /ui/.

The wheel ships web/ as the package directory exo_tp/web (see setup.py); a source checkout or an
editable install serves the repository's web/ directly.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

import exo_tp
from exo_tp.node.openai_schema import ApiError

# Explicit types: ES modules must be served as JavaScript whatever the system's mimetypes say.
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
                 ".js": "text/javascript; charset=utf-8", ".svg": "image/svg+xml",
                 ".png": "image/png"}
# Revalidate every time (ETag, 304) so a node that was upgraded never serves a stale mix.
NO_CACHE = {"Cache-Control": "no-cache"}


def web_dir() -> Path | None:
    """Where the UI files are: inside the installed package, else the checkout's web/."""
    package = Path(exo_tp.__file__).resolve().parent
    for candidate in (package / "web", package.parent / "web"):
        if (candidate / "index.html").is_file():
            return candidate
    return None


def web_routes(directory: Path | None = None) -> web.RouteTableDef:
    directory = directory or web_dir()
    routes = web.RouteTableDef()

    def serve(name: str) -> web.FileResponse:
        if directory is None:
            raise ApiError(404, "the web UI files are missing from this installation",
                           code="not_found")
        path = directory / name
        # {name} is one path segment; only the UI's own kinds of files are served
        if path.suffix not in CONTENT_TYPES or not path.is_file():
            raise ApiError(404, f"no such UI file: {name}", code="not_found")
        return web.FileResponse(path, headers={
            **NO_CACHE, "Content-Type": CONTENT_TYPES[path.suffix]})

    @routes.get("/")
    async def index(request: web.Request) -> web.FileResponse:
        return serve("index.html")

    @routes.get("/ui/{name}")
    async def asset(request: web.Request) -> web.FileResponse:
        return serve(request.match_info["name"])

    return routes
