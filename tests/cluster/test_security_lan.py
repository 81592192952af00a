"""Security on a LAN: two nodes in two network namespaces behind a bridge, and a stranger host.

The nodes get no secret: they share a config folder (as machines do once its file is copied),
so the first start generates the secret (0600) and says once how to share it, and the other
reads it. They require an API key (given in the environment) and allow one browser origin.
The stranger signs control requests and an mDNS announcement with the empty key and a wrong
one and gets nothing done; a node with no secret refuses to start on the LAN; a node without
an API key warns that it is open; a LAN client needs the key, and with it gets the answer of
single-device mlx-lm through the official openai SDK.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_helpers import CLI, Host, NamespaceLab, can_make_namespaces, http_json, wait_ready
from helpers import mlx_lm_reference
from node_views import plan_view
from openai import AuthenticationError, OpenAI

from exo_tp.node.cluster.views import ClusterView

pytestmark = pytest.mark.skipif(
    can_make_namespaces() is not None, reason=str(can_make_namespaces())
)

MODEL = "smollm2-135m"
QUESTION = "What is the capital of France?"
KEY = f"sk-lan-{secrets.token_hex(12)}"
AUTH = {"Authorization": f"Bearer {KEY}"}
GOOD_ORIGIN = "http://good.example"
FORGE = Path(__file__).resolve().parents[1] / "forge_control.py"


class Lab:
    def __init__(
        self,
        lab: NamespaceLab,
        nodes: list[Host],
        stranger: Host,
        cluster: str,
        config: Path,
        tmp: Path,
    ):
        self.lab, self.nodes, self.stranger = lab, nodes, stranger
        self.cluster, self.config, self.tmp = cluster, config, tmp

    @property
    def urls(self) -> list[str]:
        return [h.url for h in self.nodes]

    def log(self, index: int) -> str:
        return self.nodes[index].log.read_text()  # type: ignore[union-attr]

    def in_stranger(
        self, *args: str, env: dict[str, str] | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ip", "netns", "exec", self.stranger.name, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **(env or {})},
        )


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, default_models: dict[str, Path]) -> Iterator[Lab]:
    tmp = tmp_path_factory.mktemp("lan")
    config = tmp / "config"  # empty: the first node to start generates the secret
    lab = NamespaceLab()
    lab.up()
    try:
        nodes = [lab.add_host() for _ in range(2)]
        stranger = lab.add_host()
        cluster = f"lan-{lab.tag}"
        for i, host in enumerate(nodes):
            lab.start_node(
                host,
                tmp,
                "--cluster",
                cluster,
                "--node-id",
                f"node-{'ab'[i]}",
                "--weight",
                "1",
                "--model",
                MODEL,
                "--allowed-origins",
                GOOD_ORIGIN,
                env={"XDG_CONFIG_HOME": str(config), "EXO_TP_API_KEY": KEY},
            )
        wait_ready([h.url for h in nodes], nodes=2, headers=AUTH)
        yield Lab(lab, nodes, stranger, cluster, config, tmp)
    finally:
        lab.down()


@pytest.fixture(scope="module")
def reference(default_models: dict[str, Path]) -> str:
    return mlx_lm_reference(default_models[MODEL], QUESTION, 8).text


def test_first_start_generates_a_private_secret_and_says_once_how_to_share_it(lab: Lab) -> None:
    path = lab.config / "exo-tp" / "secret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    secret = path.read_text().strip()
    assert len(secret) >= 32
    logs = [lab.log(0), lab.log(1)]
    # one node generated it (and printed it once, with how to share it); the other read it
    assert sum(log.count(secret) for log in logs) == 1, logs
    notice = next(log for log in logs if secret in log)
    assert str(path) in notice and "--secret-file" in notice and "EXO_TP_SECRET" in notice
    assert all(f"cluster secret from {path}" in log for log in logs)


def test_node_without_a_secret_refuses_to_start_on_the_lan(lab: Lab) -> None:
    """No secret given and none can be stored: one readable line, exit 1, nothing served."""
    result = lab.in_stranger(
        *CLI,
        "run",
        "--host",
        lab.stranger.ip,
        "--cluster",
        lab.cluster,
        "--model",
        MODEL,
        "--weight",
        "1",
        env={"XDG_CONFIG_HOME": "/dev/null/config"},
        timeout=60,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("exo-tp: error: no cluster secret"), lines
    assert "--secret-file" in lines[0] and "Traceback" not in result.stderr


def _control_port(log: str) -> int:
    line = next(line for line in log.splitlines() if ", control port " in line)
    return int(line.split(", control port ")[1].split(",")[0])


def test_stranger_signing_with_the_empty_or_a_wrong_key_gets_nothing_done(lab: Lab) -> None:
    before = plan_view(lab.urls[0], headers=AUTH)
    controls = [f"{h.ip}:{_control_port(lab.log(i))}" for i, h in enumerate(lab.nodes)]
    wrong = secrets.token_hex(16)
    result = lab.in_stranger(
        sys.executable,
        str(FORGE),
        "--host",
        lab.stranger.ip,
        "--cluster",
        lab.cluster,
        "--key",
        "",
        "--key",
        wrong,
        *[arg for c in controls for arg in ("--control", c)],
        "--announce-seconds",
        "6",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    statuses = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(statuses) == 2 * 2 * 4
    assert set(statuses.values()) == {401}, statuses
    for i, url in enumerate(lab.urls):  # the forged announcement did not make a member
        view = ClusterView.model_validate(http_json(f"{url}/v1/cluster", headers=AUTH)[1])
        assert sorted(n.node_id for n in view.nodes) == ["node-a", "node-b"]
        assert "ignored announcement intruder" in lab.log(i)
    after = plan_view(lab.urls[1], headers=AUTH)
    assert (after.epoch, after.state, after.nodes) == (before.epoch, "ready", ("node-a", "node-b"))


def test_lan_client_needs_the_api_key(lab: Lab, reference: str) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    for url in lab.urls:
        stranger = OpenAI(base_url=f"{url}/v1", api_key="not-the-key", max_retries=0)
        with pytest.raises(AuthenticationError) as refused:
            stranger.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
        assert refused.value.status_code == 401
        assert refused.value.body["code"] == "invalid_api_key"  # type: ignore[index]
        code, reply = http_json(f"{url}/v1/cluster")
        assert code == 401 and set(reply["error"]) == {"message", "type", "param", "code"}
        assert http_json(f"{url}/health")[0] == 200
    # With the key, through the node that is not the leader (it passes the key on), streaming.
    client = OpenAI(base_url=f"{lab.urls[1]}/v1", api_key=KEY, max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=8, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reference


def _preflight(url: str, origin: str) -> tuple[int, dict[str, str]]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        method="OPTIONS",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers)


def test_only_the_allowed_origin_passes_cors(lab: Lab) -> None:
    status, headers = _preflight(lab.urls[0], GOOD_ORIGIN)
    assert status == 204 and headers["Access-Control-Allow-Origin"] == GOOD_ORIGIN
    assert "authorization" in headers["Access-Control-Allow-Headers"].lower()
    status, headers = _preflight(lab.urls[0], "http://evil.example")
    assert status == 403 and "Access-Control-Allow-Origin" not in headers


def test_open_node_on_the_lan_warns_and_allows_no_origin(lab: Lab) -> None:
    """A node without an API key on a LAN address starts, warns once, and lets no other web
    origin in (the CORS default off loopback)."""
    node = lab.stranger
    lab.lab.start_node(
        node,
        lab.tmp,
        "--cluster",
        f"open-{lab.lab.tag}",
        "--node-id",
        "open",
        "--model",
        MODEL,
        "--weight",
        "1",
        env={"EXO_TP_SECRET": secrets.token_hex(16)},
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if http_json(f"{node.url}/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, node.log.read_text()  # type: ignore[union-attr]
            time.sleep(0.5)
        status, headers = _preflight(node.url, GOOD_ORIGIN)
        assert status == 403 and "Access-Control-Allow-Origin" not in headers
        assert http_json(f"{node.url}/v1/models")[0] == 200  # open, as warned
    finally:
        lab.lab.stop_node(node)
    log = node.log.read_text()  # type: ignore[union-attr]
    assert log.count("requires no API key") == 1, log
    assert all("requires no API key" not in lab.log(i) for i in range(2))
