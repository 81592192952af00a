"""`exo-tp run`'s security flags as a user meets them: each problem is one readable line, and
no secret is ever taken from a command line. Fast: every case stops before anything heavy is
imported (a bad --allowed-origins, checked right after the secret, ends the runs that get past
the secret)."""

from __future__ import annotations

import os
import secrets
import stat
import subprocess
from pathlib import Path

import pytest
from cluster_helpers import CLI

STOP = ("--allowed-origins", "not-an-origin")  # refused just after the secret


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, "run", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode in (1, 2), result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("exo-tp: error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    return errors[0]


def test_secret_on_the_command_line_is_refused_with_the_way_out() -> None:
    line = one_error_line(run("--host", "127.0.0.1", "--secret", secrets.token_hex(16)))
    assert "--secret-file" in line and "EXO_TP_SECRET" in line and "ps" in line


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "does not exist"),
        ("", "is empty"),
        ("short", "too short"),
        (b"\xff\xfe" * 20, "not text"),
    ],
)
def test_bad_secret_files(tmp_path: Path, content: str | bytes | None, problem: str) -> None:
    path = tmp_path / "secret"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    line = one_error_line(run("--host", "127.0.0.1", "--secret-file", str(path), *STOP))
    assert str(path) in line and problem in line, line


def test_bad_secret_in_the_environment() -> None:
    line = one_error_line(run("--host", "127.0.0.1", *STOP, env={"EXO_TP_SECRET": "tiny"}))
    assert "$EXO_TP_SECRET" in line and "too short" in line


def test_secret_file_others_can_read_is_used_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text(secrets.token_hex(16))
    path.chmod(0o644)
    result = run("--host", "127.0.0.1", "--secret-file", str(path), *STOP)
    assert "can be read by other users" in result.stderr
    assert "not-an-origin" in one_error_line(result)  # it went on to the model


def test_loopback_node_without_a_storable_secret_runs_alone_and_says_so() -> None:
    result = run("--host", "127.0.0.1", *STOP, env={"XDG_CONFIG_HOME": "/dev/null/config"})
    assert "no other node can join" in result.stderr
    assert "not-an-origin" in one_error_line(result)


def test_lan_node_without_a_storable_secret_refuses_before_touching_the_network() -> None:
    """Nothing is ever bound to 10.255.255.1: the refusal comes first (the LAN case with real
    network namespaces is in test_security_lan.py)."""
    result = run("--host", "10.255.255.1", *STOP, env={"XDG_CONFIG_HOME": "/dev/null/config"})
    line = one_error_line(result)
    assert "no cluster secret" in line and "/dev/null/config" in line


def test_generated_secret_is_stored_privately_and_reused(tmp_path: Path) -> None:
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    first = run("--host", "127.0.0.1", *STOP, env=env)
    path = tmp_path / "exo-tp" / "secret"
    secret = path.read_text().strip()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(secret) >= 32
    assert secret in first.stderr and "--secret-file" in first.stderr
    again = run("--host", "127.0.0.1", *STOP, env=env)
    assert secret not in again.stderr and f"cluster secret from {path}" in again.stderr
    assert path.read_text().strip() == secret


@pytest.mark.parametrize(
    ("args", "env", "problem"),
    [
        (("--api-key-file", "/nonexistent/key"), {}, "cannot read --api-key-file"),
        (("--api-key", "two words"), {}, "one word"),
        ((), {"EXO_TP_API_KEY": ""}, "$EXO_TP_API_KEY is empty"),
        (("--allowed-origins", "example.com"), {}, "is not an origin"),
        (("--allowed-origins", "https://a.example/path"), {}, "is not an origin"),
        (("--api-key", "a", "--api-key-file", "/k"), {}, "not allowed with argument"),
    ],
)
def test_bad_access_flags(args: tuple[str, ...], env: dict[str, str], problem: str) -> None:
    result = run("--host", "127.0.0.1", *args, env={"EXO_TP_SECRET": secrets.token_hex(16), **env})
    assert problem in one_error_line(result)
