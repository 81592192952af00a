"""Routes serving the web UI from web/ (filled in by the web UI work)."""

from __future__ import annotations

from aiohttp import web


def web_routes() -> web.RouteTableDef:
    return web.RouteTableDef()
