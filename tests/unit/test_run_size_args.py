"""`exo-tp run`'s new values (issue #59): ``--max-memory`` sizes and ``--replicas`` counts or
``auto``; a bad one is one readable argparse error, never a traceback."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from exo_tp.cli.args import replicas_arg, size_arg


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8GB", 8 * 10**9), ("512M", 512 * 10**6), ("1.5g", 1_500_000_000), ("2000", 2000)],
)
def test_sizes_read_as_a_mac_counts_them(text: str, expected: int) -> None:
    assert size_arg(text) == expected


@pytest.mark.parametrize("text", ["", "0", "-1GB", "8 parsecs", "GB", "1e9"])
def test_a_bad_size_is_one_readable_error(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        size_arg(text)


def test_replicas_take_a_count_or_auto() -> None:
    assert replicas_arg("2") == 2 and replicas_arg("auto") == 0 and replicas_arg("AUTO") == 0
    for bad in ("0", "-1", "two", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="count"):
            replicas_arg(bad)


@pytest.mark.parametrize(
    "flags", [["--max-models", "0"], ["--replicas", "none"], ["--max-memory", "8 parsecs"]]
)
def test_bad_values_are_one_line_from_the_cli(flags: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "exo_tp", "run", "--no-bench", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "\n" not in done.stderr.strip() and flags[0] in done.stderr, done.stderr
