"""Argument types shared by subcommands: each turns bad input into one readable line."""

from __future__ import annotations

import argparse
import json
import math
import re
from typing import Any


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least {least}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def port_number(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1-65535)")
    return value


def positive_float(text: str) -> float:
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0")
    return value


def duration_arg(text: str) -> float:
    """``5m``, ``300``, ``1h30m`` -> seconds (negative: for ever, ``exo_tp.durations``)."""
    from exo_tp.durations import parse_duration

    try:
        return parse_duration(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


_SIZE = re.compile(r"(\d+(?:\.\d*)?)\s*([kmgt]?)i?b?", re.IGNORECASE)


def size_arg(text: str) -> int:
    """``8GB``, ``512M``, ``1.5g``, ``2000000`` -> bytes (powers of 1000: a Mac's "8 GB")."""
    match = _SIZE.fullmatch(text.strip())
    if match is None or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: use bytes or 8GB, 512MB")
    unit = match.group(2).lower()
    scale = 1000 ** (1 + "kmgt".index(unit)) if unit else 1
    return int(float(match.group(1)) * scale)


def replicas_arg(text: str) -> int:
    """``--replicas``: a count (1 or more), or ``auto`` (0: the planner chooses)."""
    if text.strip().lower() == "auto":
        return 0
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a count (1, 2 ...) or auto")
    return count


def address_list(text: str) -> list[str]:
    """``10.0.0.1,10.0.0.2`` -> one address per node (at least two)."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) < 2 or not all(parts) or any(" " in p for p in parts):
        raise argparse.ArgumentTypeError(
            f"peers {text!r} must be two or more comma-separated addresses, like 10.0.0.1,10.0.0.2"
        )
    return parts


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
    return value


def weight_list(text: str) -> list[float]:
    """``5,3,2`` -> [5.0, 3.0, 2.0]."""
    parts = [p.strip() for p in text.split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"weights {text!r} must be numbers like 5,3,2") from None
    if any(not math.isfinite(v) or v < 0 for v in values) or sum(values) <= 0:
        raise argparse.ArgumentTypeError(f"weights {text!r} must be >= 0 with a positive sum")
    return values


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    from exo_tp.models.registry import DEFAULT_MODEL, DEFAULT_MODELS

    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"model folder or name ({', '.join(DEFAULT_MODELS)}); default {DEFAULT_MODEL}",
    )


def int_list(text: str, what: str) -> list[int]:
    """``2,1`` -> [2, 1]; each at least 1 (an ExoTpError names ``what`` otherwise)."""
    from exo_tp.errors import ExoTpError

    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ExoTpError(f"{what} {text!r} must be whole numbers like 2,1") from None
    if any(v < 1 for v in values):
        raise ExoTpError(f"{what} {text!r} must all be at least 1")
    return values


def json_object(text: str) -> dict[str, Any]:
    """``'{"enable_thinking": false}'`` -> a dict."""
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"{text!r} must be a JSON object like '{{\"enable_thinking\": false}}'"
        )
    return value


def add_overlap_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--no-overlap`` (exo-tp run and launch): ServingOptions.overlap off."""
    parser.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        help="pipelines: keep one batch in flight across the stages instead of one "
        "micro-batch per stage (every stage busy under load)",
    )
