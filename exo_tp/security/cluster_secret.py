"""The cluster secret: nodes and workers prove they belong to a cluster by HMACs under it.

Where a node gets it, first found wins:
1. ``--secret-file PATH``;
2. ``$EXO_TP_SECRET`` (how ``--local-nodes`` hands it to its nodes and a node to its workers);
3. the stored secret, ``<config folder>/secret`` (see `exo_tp.paths.config_home`), created with
   0600 permissions on the first start and announced once with how to share it.
Never from a command line: ``ps`` shows command lines to every user of the machine.

A node *has no secret* when none was given and the stored one can neither be read nor created
(the config folder cannot be written). On a network (a non-loopback address) it then refuses to
start; on loopback, which only this machine reaches, it runs with a random secret held in memory
(no other node can join it) and says so. The empty secret is never used.
"""

from __future__ import annotations

import logging
import os
import secrets
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from exo_tp.errors import ExoTpError
from exo_tp.paths import config_home

log = logging.getLogger(__name__)

SECRET_ENV = "EXO_TP_SECRET"  # the cluster secret, for nodes started without a file

# An HMAC key someone could guess is no key: mDNS announcements are public and signed, so a
# short secret can be found offline by trying candidates against one of them.
MIN_LENGTH = 16
MAKE_ONE = "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"


@dataclass(frozen=True)
class ClusterSecret:
    value: str = field(repr=False)
    origin: str  # where it came from, for messages (never the value)
    generated: bool = False  # created by this start: tell the user once how to share it


def secret_path() -> Path:
    return config_home() / "secret"


def check_secret(value: str, where: str) -> str:
    if not value:
        raise ExoTpError(f"{where} is empty; a cluster secret looks like the output of {MAKE_ONE}")
    if len(value) < MIN_LENGTH:
        raise ExoTpError(
            f"{where} is too short ({len(value)} characters; at least {MIN_LENGTH}"
            f" so that it cannot be guessed): make one with {MAKE_ONE}"
        )
    return value


def read_secret_file(path: Path, what: str = "secret file") -> str:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ExoTpError(f"{what} {path} does not exist") from None
    except OSError as error:
        raise ExoTpError(f"cannot read {what} {path}: {error.strerror or error}") from None
    try:
        value = raw.decode().strip()
    except UnicodeDecodeError:
        raise ExoTpError(f"{what} {path} is not text (UTF-8)") from None
    check_secret(value, f"{what} {path}")
    if path.stat().st_mode & 0o077:
        log.warning("%s %s can be read by other users of this machine: chmod 600 it", what, path)
    return value


def _create(path: Path) -> bool:
    """Write a new random secret to ``path`` (0600); False if another process made it first."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".secret-")  # mkstemp: mode 0600
    try:
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_urlsafe(32) + "\n")
            out.flush()
            os.fsync(out.fileno())
        # link() never replaces: nodes starting together all end up with the first one's secret
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)


def stored_secret(path: Path | None = None) -> tuple[ClusterSecret | None, str]:
    """The stored secret, created if there is none yet; else (None, why it cannot be)."""
    path = path or secret_path()
    generated = False
    if not path.exists():
        try:
            generated = _create(path)
        except OSError as error:
            return None, f"{path} cannot be created ({error.strerror or error})"
    return ClusterSecret(read_secret_file(path, "stored secret"), str(path), generated), ""


def cluster_secret(
    secret_file: Path | None, network: bool, environ: Mapping[str, str] = os.environ
) -> ClusterSecret:
    """This node's secret (see the module doc); ``network``: it is reachable from other
    machines, so running without a shared secret is refused."""
    if secret_file is not None:
        return ClusterSecret(read_secret_file(secret_file), f"--secret-file {secret_file}")
    if SECRET_ENV in environ:
        value = check_secret(environ[SECRET_ENV].strip(), f"${SECRET_ENV}")
        return ClusterSecret(value, f"${SECRET_ENV}")
    stored, why = stored_secret()
    if stored is not None:
        return stored
    if network:
        raise ExoTpError(
            f"no cluster secret: none was given and {why}. A node on a network "
            f"never runs without one: give every node the same secret with "
            f"--secret-file FILE or ${SECRET_ENV}"
        )
    log.warning(
        "no cluster secret (%s): using a random one held in memory, so no other node "
        "can join this one; give one with --secret-file FILE or $%s",
        why,
        SECRET_ENV,
    )
    return ClusterSecret(secrets.token_urlsafe(32), "random, in memory only")


def share_notice(secret: ClusterSecret) -> str:
    """What a node prints once, when it generated the stored secret."""
    return (
        f"exo-tp: generated this machine's cluster secret and stored it in {secret.origin} "
        f"(readable only by you): {secret.value}\n"
        f"  Every node of the cluster needs the same secret: copy that file to the same "
        f"place on each machine,\n  or start the nodes with --secret-file FILE or with "
        f"{SECRET_ENV} set in their environment (never on a command line)."
    )
