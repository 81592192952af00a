"""Human-readable quantities for tables (pure)."""

from __future__ import annotations


def size(nbytes: float) -> str:
    """1536 -> '1.5 KB' (powers of 1000, like disk and network figures)."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(nbytes) < 1000:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.3g} {unit}"
        nbytes /= 1000
    return f"{nbytes:.3g} TB"


def rate(per_second: float, unit: str = "B") -> str:
    """3.2e9 -> '3.2 GB/s'; with unit 'FLOP' -> '3.2 GFLOP/s'."""
    for prefix in ("", "K", "M", "G", "T"):
        if abs(per_second) < 1000 or prefix == "T":
            return f"{per_second:.3g} {prefix}{unit}/s"
        per_second /= 1000
    raise AssertionError("unreachable")


def duration(seconds: float) -> str:
    """0.000085 -> '85 µs', 0.0123 -> '12.3 ms', 1.5 -> '1.5 s'."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s"
