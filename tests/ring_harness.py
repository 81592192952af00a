"""Run a Python script on N real ranks (MLX ring over loopback) and collect rank 0's JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from exo_tp.transport.ports import free_ports
from exo_tp.transport.ring import ring_env, write_hostfile


def run_on_ranks(n: int, script: str, tmp: Path, timeout: float = 120) -> dict:
    """``script`` runs on every rank with ``group`` joined and ``OUT`` the result path; rank 0
    must write JSON there. One rank runs without a ring (MLX's group of one)."""
    hostfile, out, code = tmp / "hosts.json", tmp / "out.json", tmp / "script.py"
    write_hostfile(hostfile, [f"127.0.0.1:{p}" for p in free_ports(n)])
    code.write_text(
        "import mlx.core as mx\n"
        "from exo_tp.transport.ring import init_ring, barrier\n"
        f"OUT = {str(out)!r}\n"
        "group = init_ring()\n" + script + "\nbarrier(group)\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(code)],
            env={**os.environ, **(ring_env(r, hostfile) if n > 1 else {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(n)
    ]
    deadline = time.monotonic() + timeout
    try:
        # Fail fast: one failed rank leaves the others waiting in a collective.
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(c == 0 for c in codes) or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.05)
        codes = [p.poll() for p in procs]
    finally:
        for p in procs:
            p.kill()
    for r, (p, code) in enumerate(zip(procs, codes, strict=True)):
        assert code in (None, 0), f"rank {r} exited {code}: {p.stderr.read()[-2000:]}"
    assert all(code == 0 for code in codes), f"ranks still running after {timeout}s: {codes}"
    return json.loads(out.read_text())
