"""Cluster membership proof: HMAC-SHA256 with the cluster secret, which never leaves the node."""

from __future__ import annotations

import hashlib
import hmac
import time

MAX_CLOCK_SKEW = 60.0  # seconds a signed control message stays valid


def sign(secret: str, message: bytes) -> str:
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def verify(secret: str, message: bytes, signature: str) -> bool:
    return hmac.compare_digest(sign(secret, message), signature)


def control_message(timestamp: str, path: str, body: bytes) -> bytes:
    return f"{timestamp}\n{path}\n".encode() + body


def control_headers(secret: str, path: str, body: bytes) -> dict[str, str]:
    """Headers authenticating a control request (replays older than a minute are refused)."""
    timestamp = f"{time.time():.3f}"
    return {
        "X-Exo-Tp-Time": timestamp,
        "X-Exo-Tp-Signature": sign(secret, control_message(timestamp, path, body)),
    }


def control_request_ok(secret: str, path: str, body: bytes, headers: dict[str, str]) -> bool:
    timestamp, signature = headers.get("X-Exo-Tp-Time"), headers.get("X-Exo-Tp-Signature")
    if not timestamp or not signature:
        return False
    try:
        if abs(time.time() - float(timestamp)) > MAX_CLOCK_SKEW:
            return False
    except ValueError:
        return False
    return verify(secret, control_message(timestamp, path, body), signature)
