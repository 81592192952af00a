"""Which addresses only this machine can reach."""

from __future__ import annotations

import ipaddress


def is_loopback(address: str) -> bool:
    """True for 127.0.0.0/8, ::1 and "localhost"; False for anything else, including the
    wildcard 0.0.0.0 (every interface) and names that need resolving."""
    if address.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False
