"""`exo-tp run --local-nodes N`: a whole cluster of N node daemons on this machine."""

from __future__ import annotations

import secrets
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from exo_tp.errors import ExoTpError
from exo_tp.runtime.ports import port_is_free


def run_local_cluster(count: int, weights: Sequence[float] | None, model: str, api_port: int,
                      dtype: str, extra: Sequence[str] = (),
                      profiles: Sequence[Path] | None = None) -> int:
    if weights is not None and len(weights) != count:
        raise ExoTpError(f"--weights has {len(weights)} values for {count} local nodes")
    ports = [api_port + i for i in range(count)]
    taken = [p for p in ports if not port_is_free(p)]
    if taken:
        raise ExoTpError(f"API ports {taken} are in use; pick another --api-port")
    cluster, secret = f"local-{secrets.token_hex(4)}", secrets.token_hex(16)
    procs = []
    try:
        for i, port in enumerate(ports):
            args = [sys.executable, "-m", "exo_tp", "run", "--host", "127.0.0.1",
                    "--api-port", str(port), "--node-id", f"local-{i}", "--cluster", cluster,
                    "--secret", secret, "--model", model, "--dtype", dtype, *extra]
            if weights is not None:
                args += ["--weight", str(weights[i])]
            if profiles is not None:
                args += ["--profile", str(profiles[i])]
            procs.append(subprocess.Popen(args))
        print(f"local cluster {cluster!r} of {count} nodes: "
              + ", ".join(f"http://127.0.0.1:{p}" for p in ports), flush=True)
        while True:
            for i, proc in enumerate(procs):
                if proc.poll() is not None:
                    raise ExoTpError(f"local node {i} exited with code {proc.returncode}")
            time.sleep(0.5)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
