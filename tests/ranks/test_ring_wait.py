"""Ranks waiting in a ring collective sleep instead of spinning a core (exo_tp.transport.ring_wait).

The waiting rank's own CPU time tells: MLX's socket thread spins on EAGAIN for as long as its
peer is late, so without the wait library the CPU time is close to the wait; with it, a few
milliseconds. The spinning run is the control that shows the measure can fail.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
from ring_harness import run_on_ranks

from exo_tp.errors import ExoTpError
from exo_tp.transport import ring_wait
from exo_tp.transport.ring_wait import WAIT_ENV, sleeping_waits

pytestmark = [
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="the wait library is preloaded on Linux only"
    ),
    pytest.mark.alone,  # under pytest-xdist: it measures a waiting rank's CPU time
]

LATE = 1.5  # seconds rank 1 comes late to the all_sum
WAIT = f"""
import json, time
from pathlib import Path
if group.rank() == 1:
    time.sleep({LATE})
started = time.process_time()
total = mx.distributed.all_sum(mx.array([1.0 + group.rank()]), group=group)
mx.eval(total)
cpu = time.process_time() - started
if group.rank() == 0:
    loaded = "ring-wait" in Path("/proc/self/maps").read_text()
    Path(OUT).write_text(json.dumps({{"cpu": cpu, "sum": total.item(), "loaded": loaded}}))
"""


def test_a_rank_waiting_for_a_late_peer_sleeps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outcomes = {}
    for wait in ("spin", "sleep"):
        monkeypatch.setenv(WAIT_ENV, wait)
        (tmp_path / wait).mkdir()
        outcomes[wait] = run_on_ranks(2, WAIT, tmp_path / wait)
        assert outcomes[wait]["sum"] == 3.0
    print(outcomes)
    # MLX as it is: the socket thread spins for as long as it gets a core in the wait
    assert not outcomes["spin"]["loaded"] and outcomes["spin"]["cpu"] > 0.2 * LATE, outcomes
    assert outcomes["sleep"]["loaded"], outcomes
    assert outcomes["sleep"]["cpu"] < min(0.1 * LATE, outcomes["spin"]["cpu"] / 4), outcomes


def test_auto_sleeps_only_where_a_hosts_ranks_outnumber_its_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ring_wait, "_cores", lambda: 2)
    assert sleeping_waits({}, ranks_here=2) == {}  # a core each: MLX's spin is the faster
    assert "LD_PRELOAD" in sleeping_waits({}, ranks_here=3)
    assert "LD_PRELOAD" in sleeping_waits({WAIT_ENV: "sleep"}, ranks_here=1)
    assert sleeping_waits({WAIT_ENV: "spin"}, ranks_here=3) == {}


def test_the_library_goes_first_and_keeps_what_was_preloaded() -> None:
    base = {"LD_PRELOAD": "libopenblas.so.0", WAIT_ENV: "sleep"}
    preload = sleeping_waits(base)["LD_PRELOAD"].split()
    assert Path(preload[0]).name.startswith("ring-wait-") and Path(preload[0]).is_file()
    assert preload[1:] == ["libopenblas.so.0"]
    assert sleeping_waits({**base, "LD_PRELOAD": " ".join(preload)}) == {}  # preloaded once
    assert sleeping_waits({WAIT_ENV: "spin"}) == {}


def test_no_compiler_means_spinning_ranks_and_one_log_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("EXO_TP_HOME", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", "/bin/false")
    ring_wait.wait_library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=ring_wait.__name__):
            assert sleeping_waits({WAIT_ENV: "sleep"}) == {}
            assert sleeping_waits({WAIT_ENV: "sleep"}) == {}
    finally:
        ring_wait.wait_library.cache_clear()
    assert [r.getMessage()[:16] for r in caplog.records] == ["ring waits spin:"]


def test_an_unknown_choice_is_refused() -> None:
    with pytest.raises(ExoTpError, match="auto, sleep or spin"):
        sleeping_waits({WAIT_ENV: "nap"})
