"""`exo-tp run`'s security flags: the cluster secret, the API key, the allowed origins."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from exo_tp.security.access import API_KEY_ENV, ApiAccess, parse_origins
from exo_tp.security.addresses import is_loopback
from exo_tp.security.cluster_secret import (
    SECRET_ENV,
    ClusterSecret,
    check_secret,
    cluster_secret,
    read_secret_file,
    share_notice,
)

log = logging.getLogger(__name__)


class _SecretOnCommandLine(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        parser.error(
            f"--secret is gone: a command line is visible to every user in `ps`; put "
            f"the secret in a file for --secret-file FILE, or in ${SECRET_ENV}"
        )


def add_security_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--secret-file",
        type=Path,
        metavar="FILE",
        help=f"file holding the cluster secret (default: ${SECRET_ENV}, else this "
        f"user's stored secret, generated on first start in "
        f"~/.config/exo-tp/secret); every node needs the same",
    )
    p.add_argument("--secret", action=_SecretOnCommandLine, help=argparse.SUPPRESS)
    key = p.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"require this key on the public API ('Authorization: Bearer KEY' or "
        f"'x-api-key: KEY'; not on /health and the web UI's files); "
        f"--api-key-file or ${API_KEY_ENV} keep it out of `ps`",
    )
    key.add_argument(
        "--api-key-file",
        type=Path,
        metavar="FILE",
        help="like --api-key, the key read from this file",
    )
    p.add_argument(
        "--allowed-origins",
        metavar="ORIGINS",
        help="web pages allowed to call the API from a browser (CORS): * or a comma "
        "list like https://app.example.com,http://localhost:3000 (default: * "
        "when the API listens on loopback only, else none)",
    )


def node_secret(secret_file: Path | None, network: bool) -> ClusterSecret:
    """A node's secret (`exo_tp.security.cluster_secret`); says once how to share a new one."""
    secret = cluster_secret(secret_file, network)
    if secret.generated:
        print(share_notice(secret), file=sys.stderr, flush=True)
    log.info("cluster secret from %s", secret.origin)
    return secret


def local_cluster_secret(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> str:
    """`--local-nodes`: --secret-file or $EXO_TP_SECRET if given, else a fresh random secret
    (the cluster's name is random too: nothing outside this launcher joins it)."""
    if args.secret_file is not None:
        return read_secret_file(args.secret_file)
    if SECRET_ENV in environ:
        return check_secret(environ[SECRET_ENV].strip(), f"${SECRET_ENV}")
    return secrets.token_urlsafe(32)


def api_access(key: str | None, allowed_origins: str | None, listen: str) -> ApiAccess:
    """The public API's ``key`` (`read_api_key`) and CORS origins for a node whose API listens
    on ``listen``; warns once when that is reachable from other machines and no key is
    required."""
    local = is_loopback(listen)
    access = ApiAccess(
        api_key=SecretStr(key) if key else None,
        allowed_origins=parse_origins(allowed_origins, local),
    )
    if key is None and not local:
        log.warning(
            "the API listens on %s, reachable from other machines, and requires no API "
            "key: anyone who can reach it can use the cluster. Set one with "
            "--api-key-file FILE or $%s.",
            listen or "every interface",
            API_KEY_ENV,
        )
    return access
