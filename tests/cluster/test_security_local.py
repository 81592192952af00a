"""Security and faults of a real `exo-tp run --local-nodes 2` cluster with an API key.

The launcher gets the secret from --secret-file (a decoy in $EXO_TP_SECRET must lose) and the
API key from $EXO_TP_API_KEY; neither may appear on any command line. Every endpoint but
/health and the UI's files needs the key (the official openai SDK's api_key), bodies must be
JSON, browsers get CORS answers, and the web UI asks for the key once. Then the leader node is
killed twice: a stream passed through the other node ends with an error event the openai SDK
raises as an APIError, a plain request gets a 503, the survivor keeps serving (re-planned on
its own) and the launcher restarts the dead node, which rejoins.
"""

from __future__ import annotations

import http.client
import os
import secrets
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import psutil
import pytest
from cluster_helpers import LocalCluster, http_json, local_cluster, wait_ready
from helpers import mlx_lm_reference
from openai import APIError, AuthenticationError, OpenAI

MODEL = "smollm2-135m"
QUESTION = "What is the capital of France?"
KEY = f"sk-local-{secrets.token_hex(12)}"
AUTH = {"Authorization": f"Bearer {KEY}"}
SECRET = secrets.token_urlsafe(32)
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": QUESTION}],
    "temperature": 0,
    "max_tokens": 8,
}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("local-security")


@pytest.fixture(scope="module")
def cluster(tmp: Path, default_models: dict[str, Path]) -> Iterator[LocalCluster]:
    secret_file = tmp / "secret"
    secret_file.write_text(SECRET + "\n")
    secret_file.chmod(0o600)
    env = {"EXO_TP_SECRET": secrets.token_urlsafe(32), "EXO_TP_API_KEY": KEY}
    with local_cluster(
        2,
        weights=[0.6, 0.4],
        extra=("--secret-file", str(secret_file)),
        env=env,
        log=tmp / "launcher.log",
        headers=AUTH,
    ) as running:
        yield running


@pytest.fixture(scope="module")
def reference(default_models: dict[str, Path]) -> str:
    return mlx_lm_reference(default_models[MODEL], QUESTION, 8).text


def _tree(cluster: LocalCluster) -> list[psutil.Process]:
    launcher = psutil.Process(cluster.proc.pid)
    return [launcher, *launcher.children(recursive=True)]


def _node(cluster: LocalCluster, index: int) -> psutil.Process:
    (node,) = [p for p in _tree(cluster) if f"local-{index}" in p.cmdline()]
    return node


def test_no_secret_or_key_on_any_command_line(cluster: LocalCluster) -> None:
    """ps shows command lines to every user; environments only to the process's owner."""
    tree = _tree(cluster)
    nodes = [p for p in tree if "--node-id" in p.cmdline()]
    assert len(nodes) == 2
    # what the cluster really authenticates with: the key its ranks' links were given (hex)
    links = {
        p.environ().get("EXO_TP_LINK_KEY")
        for p in tree
        if p not in nodes and p.pid != cluster.proc.pid
    }
    assert links and all(links)
    given = {bytes.fromhex(k).decode() for k in links if k}
    for process in psutil.process_iter(["pid", "cmdline"]):
        line = " ".join(process.info["cmdline"] or [])
        assert not any(s in line for s in (*given, *links, KEY)), (process.info["pid"], line)
    assert given == {SECRET}, "the workers do not hold the --secret-file secret"


OPEN = ["/health", "/", "/ui/app.js"]
PROTECTED = [
    ("GET", "/v1/models"),
    ("GET", "/v1/cluster"),
    ("GET", "/v1/plan"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("GET", "/v1/nothing-here"),
]


def _call(
    url: str, method: str, path: str, headers: dict[str, str], body: bytes | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One raw request: no client adds or normalizes a header."""
    parsed = urlparse(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


@pytest.mark.parametrize("node", [0, 1], ids=["leader", "other-node"])
def test_every_endpoint_but_health_and_the_ui_needs_the_key(
    cluster: LocalCluster, node: int
) -> None:
    import json

    url = cluster.urls[node]
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    for method, path in PROTECTED:
        data = body if method == "POST" else None
        json_type = {"Content-Type": "application/json"}
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"x-api-key": "wrong"},
            {"Authorization": f"Basic {KEY}"},
        ):
            status, got, raw = _call(url, method, path, {**json_type, **headers}, data)
            assert status == 401, (method, path, headers, raw)
            error = json.loads(raw)["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == "invalid_api_key" and "API key" in error["message"]
            assert got["WWW-Authenticate"].startswith("Bearer")
    for path in OPEN:
        assert _call(url, "GET", path, {})[0] == 200, path
    assert _call(url, "GET", "/v1/models", {"x-api-key": KEY})[0] == 200  # anthropic SDK style
    assert _call(url, "GET", "/v1/models", AUTH)[0] == 200


def test_openai_sdk_needs_the_key(cluster: LocalCluster, reference: str) -> None:
    """Through the node that is not the leader: it passes the client's key on."""
    wrong = OpenAI(base_url=f"{cluster.urls[1]}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(AuthenticationError):
        wrong.models.list()
    with pytest.raises(AuthenticationError):
        wrong.chat.completions.create(**CHAT)
    client = OpenAI(base_url=f"{cluster.urls[1]}/v1", api_key=KEY, max_retries=0, timeout=120)
    assert client.chat.completions.create(**CHAT).choices[0].message.content == reference


@pytest.mark.parametrize("node", [0, 1], ids=["leader", "other-node"])
def test_json_endpoints_take_only_json_bodies(cluster: LocalCluster, node: int) -> None:
    """What a cross-site form or fetch can send without a preflight gets a 415."""
    import json

    url, body = cluster.urls[node], json.dumps(CHAT | {"max_tokens": 1}).encode()
    for kind in (
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        None,
    ):
        headers = {**AUTH, **({"Content-Type": kind} if kind else {})}
        status, _, raw = _call(url, "POST", "/v1/chat/completions", headers, body)
        assert status == 415, (kind, raw)
        assert json.loads(raw)["error"]["code"] == "unsupported_media_type"
    status, _, raw = _call(
        url,
        "POST",
        "/v1/chat/completions",
        {**AUTH, "Content-Type": "application/json; charset=utf-8"},
        body,
    )
    assert status == 200, raw


def test_cors_on_a_loopback_node_allows_any_origin(cluster: LocalCluster) -> None:
    origin = "http://app.example:3000"
    asked = "authorization, content-type, x-api-key, anthropic-version, x-stainless-os"
    status, headers, _ = _call(
        cluster.urls[0],
        "OPTIONS",
        "/v1/chat/completions",
        {
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": asked,
        },
    )
    assert status == 204
    assert headers["Access-Control-Allow-Origin"] in ("*", origin)
    assert "POST" in headers["Access-Control-Allow-Methods"]
    allowed = {h.strip() for h in headers["Access-Control-Allow-Headers"].lower().split(",")}
    assert {h.strip() for h in asked.split(",")} <= allowed
    assert int(headers["Access-Control-Max-Age"]) > 0
    for auth in (AUTH, {}):  # answers and refusals alike are readable by the page
        status, headers, _ = _call(cluster.urls[1], "GET", "/v1/models", {"Origin": origin, **auth})
        assert status == (200 if auth else 401)
        assert headers["Access-Control-Allow-Origin"] in ("*", origin)
        assert "Origin" in headers["Vary"]


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
# as in test_web_ui.py: offline, explicit binaries (selenium never downloads a driver)
CHROME_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1300,900",
)
DIALOG = """const d = document.getElementById('key-dialog');
return {open: d.open, message: document.getElementById('key-message').textContent,
        epoch: document.body.dataset.planEpoch || ''};"""
POLLS = """return performance.getEntriesByType('resource')
  .filter((e) => new URL(e.name).pathname === '/v1/cluster').length;"""
LAST_ANSWER = """const all = document.querySelectorAll('#messages .message.assistant');
const last = all[all.length - 1];
return last ? [last.dataset.state, last.querySelector('.content').textContent] : null;"""
CROSS_ORIGIN_FETCH = """const [url, key, done] = arguments;
fetch(url, {headers: {Authorization: 'Bearer ' + key}})
  .then((r) => done(r.status), (e) => done(String(e)));"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("needs Debian's chromium and chromium-driver (.ci/install installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _until(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"{what} (after {timeout}s)"
        time.sleep(0.1)
    return value


def _enter_key(driver: Any, key: str) -> None:
    from selenium.webdriver.common.by import By

    field = driver.find_element(By.ID, "key-input")
    field.clear()
    field.send_keys(key)
    driver.find_element(By.ID, "key-save").click()


def test_web_ui_asks_for_the_key_once_and_keeps_it(
    cluster: LocalCluster, browser: Any, reference: str
) -> None:
    from selenium.webdriver.common.by import By

    browser.get(cluster.urls[1] + "/")
    shown = _until(
        lambda: (s := browser.execute_script(DIALOG))["open"] and s,
        20,
        "the page never asked for the API key",
    )
    assert "API key" in shown["message"] and not shown["epoch"]
    _enter_key(browser, "sk-wrong")
    shown = _until(
        lambda: (s := browser.execute_script(DIALOG))["open"] and "refused" in s["message"] and s,
        20,
        "a wrong key was not asked again",
    )
    _enter_key(browser, KEY)
    _until(
        lambda: (s := browser.execute_script(DIALOG))["epoch"] and not s["open"],
        30,
        "the page did not load the cluster with the key",
    )
    assert browser.execute_script("return localStorage.getItem('exo-tp-api-key')") == KEY
    # Asked once, not again: wait until two more /v1/cluster polls have completed (the page
    # starts the next poll only after handling the last one), then the dialog must be shut.
    polls = browser.execute_script(POLLS)
    _until(lambda: browser.execute_script(POLLS) >= polls + 2, 20, "the page stopped polling")
    assert not browser.execute_script(DIALOG)["open"]

    for element_id, value in (
        ("chat-temperature", "0"),
        ("chat-max-tokens", "8"),
        ("chat-input", QUESTION),
    ):
        field = browser.find_element(By.ID, element_id)
        field.clear()
        field.send_keys(value)
    browser.find_element(By.ID, "chat-send").click()
    state, text = _until(
        lambda: (a := browser.execute_script(LAST_ANSWER)) and a[0] in ("done", "error") and a,
        90,
        "the chat never finished",
    )
    assert (state, text) == ("done", reference)

    browser.refresh()  # the key stays in the browser
    _until(lambda: browser.execute_script(DIALOG)["epoch"], 30, "no cluster after a reload")
    assert not browser.execute_script(DIALOG)["open"]
    # A real browser's CORS check: this page's origin (node 1's port) calls node 0 with the
    # key in an Authorization header, which needs a preflight that names it.
    status = browser.execute_async_script(CROSS_ORIGIN_FETCH, cluster.urls[0] + "/v1/models", KEY)
    assert status == 200


def _leader_index(cluster: LocalCluster) -> int:
    """Which node leads now: local-0 at first; after it died and came back, the node that
    replaced it (leadership stays with it)."""
    leader = http_json(f"{cluster.urls[0]}/v1/cluster", headers=AUTH, timeout=5)[1]["leader"]
    return int(leader.rsplit("-", 1)[1])


def _kill_leader_node(cluster: LocalCluster, leader: int = 0) -> None:
    os.kill(_node(cluster, leader).pid, signal.SIGKILL)


def test_leader_death_ends_a_proxied_stream_with_an_error_event(
    cluster: LocalCluster, tmp: Path, reference: str
) -> None:
    survivor = _node(cluster, 1).pid
    client = OpenAI(base_url=f"{cluster.urls[1]}/v1", api_key=KEY, max_retries=0, timeout=120)
    outcome: dict[str, Any] = {}
    first_token = threading.Event()

    def long_stream() -> None:
        try:
            stream = client.chat.completions.create(
                model=MODEL,
                temperature=0,
                max_tokens=2000,
                stream=True,
                messages=[{"role": "user", "content": "Write a very long story."}],
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    first_token.set()
            outcome["error"] = None
        except Exception as error:  # noqa: BLE001 - the kind of error is what is tested
            outcome["error"] = error
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=long_stream)
    thread.start()
    assert first_token.wait(120), "generation never started"
    _kill_leader_node(cluster)
    killed = time.monotonic()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the proxied stream hung"
    error = outcome["error"]
    # exactly APIError: the SDK read an error event, not a broken body (httpx errors) nor a
    # connection failure (APIConnectionError, a subclass)
    assert type(error) is APIError, repr(error)
    assert "went away" in error.message and outcome["at"] - killed < 10

    # The survivor keeps serving: its leader re-plans without the dead node...
    seen: list[list[str]] = []

    def alone() -> bool:
        code, plan = http_json(f"{cluster.urls[1]}/v1/plan", headers=AUTH, timeout=2)
        seen.append(plan.get("nodes"))
        return code == 200 and plan["nodes"] == ["local-1"]

    _until(alone, 60, f"node 1 never re-planned alone: {seen[-5:]}")
    # ... and the launcher restarts it, which rejoins: two ranks again.
    wait_ready(cluster.urls, nodes=2, headers=AUTH, timeout=180)
    assert _node(cluster, 1).pid == survivor
    log = (tmp / "launcher.log").read_text()
    assert "local node 0" in log and "exited with code -9" in log and "restarting" in log
    client = OpenAI(base_url=f"{cluster.urls[1]}/v1", api_key=KEY, max_retries=0, timeout=120)
    assert client.chat.completions.create(**CHAT).choices[0].message.content == reference


def test_leader_death_gives_a_proxied_request_a_503(cluster: LocalCluster) -> None:
    import json

    outcome: dict[str, Any] = {}
    body = json.dumps(
        CHAT | {"max_tokens": 2000, "messages": [{"role": "user", "content": "Tell a long story."}]}
    )

    leader = _leader_index(cluster)  # the test before killed local-0, which then came back
    member = 1 - leader

    def long_request() -> None:
        outcome["reply"] = _call(
            cluster.urls[member],
            "POST",
            "/v1/chat/completions",
            {**AUTH, "Content-Type": "application/json"},
            body.encode(),
        )

    thread = threading.Thread(target=long_request)
    thread.start()
    # passed on over the leader's cluster listener: its dispatcher shows the request
    _until(
        lambda: (
            http_json(f"{cluster.urls[leader]}/v1/cluster", headers=AUTH, timeout=2)[1]["serving"][
                "in_flight"
            ]
            > 0
        ),
        30,
        "the request never reached the leader",
    )
    _kill_leader_node(cluster, leader)
    thread.join(timeout=30)
    assert not thread.is_alive(), "the proxied request hung"
    status, _, raw = outcome["reply"]
    assert status == 503, raw
    error = json.loads(raw)["error"]
    assert error["code"] == "cluster_not_ready" and "went away" in error["message"]
