"""Who may use a node's public API: its API key and the browser origins allowed (CORS)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import SecretStr

from exo_tp.errors import ExoTpError
from exo_tp.frozen import Frozen

API_KEY_ENV = "EXO_TP_API_KEY"
ANY_ORIGIN = "*"


class ApiAccess(Frozen):
    """``api_key``: required on every endpoint but /health and the UI's files (None: open).
    ``allowed_origins``: browser origins whose pages may call the API, or ("*",) for any."""

    api_key: SecretStr | None = None
    allowed_origins: tuple[str, ...] = ()

    def origin_allowed(self, origin: str) -> bool:
        return ANY_ORIGIN in self.allowed_origins or origin.lower() in self.allowed_origins

    def auth_headers(self) -> dict[str, str]:
        """Headers for this node's own calls to another node's public API."""
        if self.api_key is None:
            return {}
        return {"Authorization": f"Bearer {self.api_key.get_secret_value()}"}


def read_api_key(
    key: str | None, key_file: Path | None, environ: Mapping[str, str] = os.environ
) -> str | None:
    """--api-key, else the first line of --api-key-file, else $EXO_TP_API_KEY; None: no key."""
    where = "--api-key"
    if key is None and key_file is not None:
        where = f"--api-key-file {key_file}"
        try:
            key = key_file.read_text().strip()
        except (OSError, UnicodeDecodeError) as error:
            raise ExoTpError(
                f"cannot read {where}: {getattr(error, 'strerror', None) or error}"
            ) from None
    elif key is None:
        if API_KEY_ENV not in environ:
            return None
        where, key = f"${API_KEY_ENV}", environ[API_KEY_ENV].strip()
    if not key:
        raise ExoTpError(f"{where} is empty")
    if any(c.isspace() or not c.isprintable() for c in key):
        raise ExoTpError(f"{where} must be one word (it travels in an HTTP header)")
    return key


def parse_origins(text: str | None, loopback_only: bool) -> tuple[str, ...]:
    """--allowed-origins: ``*`` or a comma list of origins (scheme://host[:port]). Default:
    any origin when the API listens on loopback only, none otherwise."""
    if text is None:
        return (ANY_ORIGIN,) if loopback_only else ()
    origins = []
    for part in (p.strip() for p in text.split(",")):
        if part == ANY_ORIGIN:
            origins.append(part)
            continue
        url = urlsplit(part.rstrip("/"))
        if (
            url.scheme not in ("http", "https")
            or not url.hostname
            or url.path
            or url.query
            or url.username
        ):
            raise ExoTpError(
                f"--allowed-origins: {part!r} is not an origin; write each like "
                f"https://app.example.com or http://localhost:3000, or * for any"
            )
        origins.append(f"{url.scheme}://{url.netloc}".lower())
    return tuple(origins)
