"""web/ ships in the wheel as exo_tp/web, and an installed (non-editable) exo-tp serves it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UI_FILES = sorted(p.name for p in (ROOT / "web").iterdir() if p.is_file())

# Runs with only the installed copy on the path: serves the UI's routes, fetches every file.
SERVE = """
import asyncio, json, sys, urllib.request
from aiohttp import web
import exo_tp
from exo_tp.api.web import web_dir, web_routes

async def main():
    app = web.Application()
    app.add_routes(web_routes())
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]

    def get(path):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.headers["Content-Type"], response.read().decode()

    paths = ["/"] + ["/ui/" + name for name in json.loads(sys.argv[1])]
    served = {p: await asyncio.get_running_loop().run_in_executor(None, get, p) for p in paths}
    await runner.cleanup()
    print(json.dumps({"package": exo_tp.__file__, "web_dir": str(web_dir()), "served": served}))

asyncio.run(main())
"""


def test_wheel_ships_and_serves_the_ui(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "-q",
            "-w",
            str(tmp_path / "wheels"),
        ],
        check=True,
        timeout=300,
    )
    wheel = next((tmp_path / "wheels").glob("exo_tp-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"exo_tp/web/{name}" for name in UI_FILES} <= names
    assert "exo_tp/api/web.py" in names

    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
        timeout=300,
    )
    env = {**os.environ, "PYTHONPATH": str(site)}  # the installed copy, not this checkout
    result = subprocess.run(
        [sys.executable, "-c", SERVE, json.dumps(UI_FILES)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert Path(report["package"]).is_relative_to(site)
    assert Path(report["web_dir"]) == site / "exo_tp" / "web"
    content_type, index = report["served"]["/"]
    assert content_type.startswith("text/html")
    assert index == (ROOT / "web" / "index.html").read_text()
    for name in UI_FILES:
        content_type, text = report["served"][f"/ui/{name}"]
        assert text == (ROOT / "web" / name).read_text(), name
        if name.endswith(".js"):  # browsers refuse modules served as anything else
            assert content_type.startswith("text/javascript")
