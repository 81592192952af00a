"""The web UI in a real headless Chromium against a real local 3-node cluster (shares 5/3/2).

The page must show what the node's own API says: three devices whose heads, KV heads, FFN rows
and vocab rows (with the logits gather's padding) are exactly /v1/plan's, bars sized by those
counts; a chat answer that streams in and equals the API's own non-streamed greedy answer; API
errors in the page; a live re-plan when a node hangs; and a lost node in a visible banner.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import re
import shutil
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest
from cluster_helpers import LocalCluster, LongStream, http_json, local_cluster, wait_ready

from exo_tp.node.cluster.views import plan_view
from exo_tp.plan import load_spec
from exo_tp.plan.cluster import Cluster, DeviceCost
from exo_tp.plan.pipeline import plan_pipeline
from exo_tp.plan.predict import predict
from exo_tp.runtime.speed_probe import PROBE_SECONDS

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="needs Debian's chromium and chromium-driver (.ci/install installs them)",
)

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("EXO_TP_ARTIFACTS", ROOT / "artifacts"))
MODEL = "smollm2-135m"
QUESTION = "What is the capital of France?"
MAX_TOKENS = 24
FINISHED_JOB = ("succeeded", "failed", "cancelled")
# Offline: no component updates, no sync, no first-run network; explicit binaries so selenium
# never tries to download a driver.
CHROME_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1500,1000",
)

# Everything the layout draws, read in one go (the page redraws while polling).
READ_LAYOUT = """
const bar = (el) => el.closest('.bar').getBoundingClientRect().width;
return [...document.querySelectorAll('#layout [data-kind]')].map((el) => ({
  ...el.dataset, text: el.textContent,
  fraction: el.closest('.bar') ? el.getBoundingClientRect().width / bar(el) : null}));
"""
READ_CHAT = """
const answers = document.querySelectorAll('#messages .message.assistant');
const last = answers[answers.length - 1];
return last ? {state: last.dataset.state, text: last.querySelector('.content').textContent,
               stats: document.getElementById('chat-stats').textContent,
               tps: document.getElementById('chat-stats').dataset.tps} : null;
"""


@pytest.fixture(scope="module")
def cluster(default_models: dict[str, Path]) -> Iterator[LocalCluster]:
    # strict names: the page must show a 404 for an unknown model (test_api_errors_...);
    # rebalancing on: the ranks probe their live speeds for the balance panel (the manual
    # weights are never re-planned over)
    extra = ("--strict-model-names", "--rebalance", "on")
    with local_cluster(3, weights=[5, 3, 2], extra=extra) as running:
        yield running


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
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


@pytest.fixture(scope="module")
def page(cluster: LocalCluster, browser: Any) -> Any:
    """The UI as served by a node that is not the leader (chat passes through to the leader)."""
    browser.get(cluster.urls[1] + "/")
    return browser


@contextmanager
def own_tab(driver: Any) -> Iterator[None]:
    """A tab of its own for a test on another cluster: the module's page stays on the
    3-node cluster for the tests after it."""
    shared = driver.current_window_handle
    driver.switch_to.new_window("tab")
    try:
        yield
    finally:
        driver.close()
        driver.switch_to.window(shared)


def wait(driver: Any, condition: Any, timeout: float, message: str) -> Any:
    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.1).until(
            lambda d: condition(d) or None
        )
    except TimeoutException:
        raise AssertionError(f"{message} (after {timeout}s)") from None


def plan_of(url: str) -> dict[str, Any]:
    status, plan = http_json(url + "/v1/plan")
    assert status == 200 and plan["plan"] is not None, plan
    return plan


def shown_plan_epoch(driver: Any) -> str:
    return driver.execute_script("return document.body.dataset.planEpoch || ''")


def assert_layout_matches(driver: Any, response: dict[str, Any]) -> None:
    """Every device's heads, KV heads, FFN rows and vocab rows as drawn equal /v1/plan's."""
    plan, nodes = response["plan"], response["nodes"]
    shown = driver.execute_script(READ_LAYOUT)

    def one(kind: str, rank: int) -> dict[str, Any]:
        found = [e for e in shown if e["kind"] == kind and e.get("rank") == str(rank)]
        assert len(found) == 1, (kind, rank, found)
        return found[0]

    gather = next(c for c in plan["collectives"] if c["name"] == "logits")
    assert {e["node"] for e in shown if e["kind"] == "q_heads"} == set(nodes)
    total_weight = sum(plan["weights"])
    for shard in plan["ranks"]:
        rank = shard["rank"]
        share = one("share", rank)
        assert share["node"] == nodes[rank]
        assert share["fraction"] == pytest.approx(shard["weight"] / total_weight, abs=0.01)

        q = shard["heads"]["q_heads"]
        heads = one("q_heads", rank)
        size = q["stop"] - q["start"]
        assert (int(heads["start"]), int(heads["stop"]), int(heads["count"])) == (
            q["start"],
            q["stop"],
            size,
        )
        assert heads["text"] == f"{size} head{'s' if size != 1 else ''}"
        assert heads["fraction"] == pytest.approx(size / plan["spec"]["num_heads"], abs=0.01)
        assert heads["kv"] == ",".join(map(str, shard["heads"]["kv_heads"]))
        kv_lanes = {
            int(e["kv"]) for e in shown if e["kind"] == "kv_heads" and e["rank"] == str(rank)
        }
        assert kv_lanes == set(shard["heads"]["kv_heads"])

        for kind, rows in shard["ffn"].items():
            ffn = one(f"ffn:{kind}", rank)
            size = rows["stop"] - rows["start"]
            assert (int(ffn["start"]), int(ffn["stop"]), int(ffn["count"])) == (
                rows["start"],
                rows["stop"],
                size,
            )
            assert ffn["text"] == f"{size:,} rows"
            assert ffn["fraction"] == pytest.approx(
                size / plan["spec"]["ffn_sizes"][kind], abs=0.01
            )

        vocab = one("vocab", rank)
        size = shard["vocab"]["stop"] - shard["vocab"]["start"]
        assert int(vocab["count"]) == size == gather["sizes"][rank]
        assert int(vocab["padding"]) == gather["padded"] - size
        assert vocab["text"] == f"{size:,} rows"
        padded = [e for e in shown if e["kind"] == "vocab_padding" and e["rank"] == str(rank)]
        assert len(padded) == (1 if gather["padded"] > size else 0)
        if padded:
            assert padded[0]["text"] == f"+{gather['padded'] - size:,} pad"
            assert padded[0]["fraction"] == pytest.approx(
                (gather["padded"] - size) / (gather["padded"] * len(nodes)), abs=0.01
            )


def test_every_node_serves_the_page(cluster: LocalCluster) -> None:
    for url in cluster.urls:
        for path in ("/", "/ui/app.js", "/ui/style.css"):
            served = http_get(url + path)
            source = "index.html" if path == "/" else path.removeprefix("/ui/")
            assert served == (ROOT / "web" / source).read_bytes(), (url, path)
    status, body = http_json(cluster.urls[0] + "/ui/missing.js")
    assert status == 404 and "missing.js" in body["error"]["message"]


def http_get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


def test_page_shows_three_devices_and_the_plan(cluster: LocalCluster, page: Any) -> None:
    response = plan_of(cluster.urls[1])
    assert len(response["nodes"]) == 3
    wait(
        page,
        lambda d: shown_plan_epoch(d) == str(response["epoch"]),
        20,
        "the page never drew the plan",
    )
    wait(
        page,
        lambda d: len(d.find_elements(By.CSS_SELECTOR, "#nodes [data-node]")) == 3,
        10,
        "the page never showed three devices",
    )
    assert_layout_matches(page, response)

    cards = {
        e.get_attribute("data-node"): e
        for e in page.find_elements(By.CSS_SELECTOR, "#nodes [data-node]")
    }
    assert set(cards) == set(response["nodes"])
    status, view = http_json(cluster.urls[1] + "/v1/cluster")
    for rank, node in enumerate(response["nodes"]):
        assert cards[node].get_attribute("data-rank") == str(rank)
        assert cards[node].get_attribute("data-leader") == str(node == view["leader"]).lower()
        # memory used/total (live, reported by each node)
        memory = next(n for n in view["nodes"] if n["node_id"] == node)["memory"]
        assert memory["total"] > memory["used"] > 0 and memory["worker_rss"] > 0
        assert " / " in cards[node].find_element(By.CSS_SELECTOR, "[data-field=memory]").text
        # shares set by hand (--weight): no device profile, and the page says so
        assert "not profiled" in cards[node].text and "not measured" in cards[node].text
    # links: timed by the workers as their ring formed, one per pair of ring neighbours
    assert {frozenset((x["a"], x["b"])) for x in view["links"]} == {
        frozenset(pair) for pair in itertools.combinations(response["nodes"], 2)
    }
    for link in view["links"]:
        assert link["up"] and link["group_size"] == 3, link
        assert link["all_sum_latency"] > 0 and link["all_sum_bandwidth"] > 0, link
    wait(
        page,
        lambda d: "3 links measured" in d.find_element(By.ID, "topology-note").text,
        10,
        "the page never said the links were measured",
    )
    edges = page.find_elements(By.CSS_SELECTOR, "#topology-graph .edge.measured")
    assert len(edges) == 3
    assert all("ring of 3 ranks" in (e.get_attribute("data-tip") or "") for e in edges)
    assert "not measured" in page.find_element(By.ID, "predicted").text
    assert len(page.find_elements(By.CSS_SELECTOR, "#topology-graph .glyph")) == 3

    # exact counts on hover
    target = page.find_element(By.CSS_SELECTOR, '#layout [data-kind="vocab_padding"]')
    # scroll first: a scroll event hides the tooltip, and would race the hover. A frame's scroll
    # events are dispatched before its animation-frame callbacks, so two frames later they are done.
    page.execute_async_script(
        """const [element, done] = arguments;
        element.scrollIntoView({block: 'center'});
        requestAnimationFrame(() => requestAnimationFrame(() => done()));""",
        target,
    )
    ActionChains(page).move_to_element(target).perform()
    tip = page.find_element(By.ID, "tooltip")
    wait(page, lambda d: tip.is_displayed(), 5, "no tooltip on hover")
    rank = int(target.get_attribute("data-rank"))
    shard = response["plan"]["ranks"][rank]["vocab"]
    padded = next(c for c in response["plan"]["collectives"] if c["name"] == "logits")["padded"]
    assert f"{shard['stop'] - shard['start']:,} rows" in tip.text
    assert f"padded by {padded - (shard['stop'] - shard['start']):,}" in tip.text


READ_GROUPS = """
const text = (tr, field) => tr.querySelector(`[data-field=${field}]`).textContent;
return [...document.querySelectorAll('#groups tbody tr')].map((tr) => ({...tr.dataset,
  model_text: text(tr, 'model'), state_text: text(tr, 'state'), nodes_text: text(tr, 'nodes'),
  pinned_text: text(tr, 'pinned'), load_text: text(tr, 'load'),
  expires_text: text(tr, 'expires')}));
"""

# "2 running, 1 waiting" while busy, "idle 12 s" / "idle 4 min" / "idle 1 h 5 min" otherwise
LOAD_TEXT = r"\d+ running(, \d+ waiting)?|idle \d+ (s|min)|idle \d+ h( \d+ min)?"


def shown_groups(driver: Any, url: str) -> list[dict[str, Any]] | None:
    """The panel's rows once they show the groups /v1/cluster at ``url`` lists (model, replica,
    state, nodes in rank order, pinned), with that answer's groups beside them."""
    groups = http_json(url + "/v1/cluster")[1]["groups"]
    rows = driver.execute_script(READ_GROUPS)
    shown = [
        (r["model"], int(r["replica"]), r["state"], r["nodes"], int(r["ranks"]), r["pinned"])
        for r in rows
    ]
    expected = [
        (
            g["model"],
            g["replica"],
            g["state"],
            ",".join(dict.fromkeys(g["ranks"])),
            len(g["ranks"]),
            str(g["pinned"]).lower(),
        )
        for g in groups
    ]
    return list(zip(rows, groups, strict=True)) if groups and shown == expected else None


def the_one_group(driver: Any, url: str, nodes: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The panel's one row and the group /v1/cluster at ``url`` lists: the served model over
    ``nodes``, ready, shown as such."""
    pairs = wait(driver, lambda d: shown_groups(d, url), 20, f"{url}: the groups never showed")
    [(row, group)] = pairs
    assert group["group"] == "" and group["model"] == MODEL and group["state"] == "ready"
    assert row["model_text"] == MODEL and row["state_text"] == "ready"
    assert row["nodes"].split(",") == group["ranks"] == nodes
    assert row["nodes_text"] == ", ".join(nodes) + " · 3 ranks"
    return row, group


def test_groups_panel_lists_the_served_model(cluster: LocalCluster, page: Any) -> None:
    """The "Models resident" panel shows every group /v1/cluster lists: here the one model
    (--model, so pinned) over the three nodes, ready, with its load and keep-alive (a page
    of a node that does not lead: the leader's status carries them)."""
    nodes = plan_of(cluster.urls[1])["nodes"]
    row, group = the_one_group(page, cluster.urls[1], nodes)
    assert group["pinned"] is True and row["pinned"] == "true" and row["pinned_text"] == "pinned"
    assert re.fullmatch(LOAD_TEXT, row["load_text"]), row
    if group["expires_in"] is None:
        assert row["expires_text"] == "stays loaded", row
    else:
        assert row["expires_text"].startswith("unloads in "), row


def set_field(driver: Any, element_id: str, value: str) -> None:
    """Type ``value`` over the field as a user does (select all, then type): a clear() fires
    no input event, so the page's own update (the served model fills the model field until
    the user edits it) could land between the clear and the typing and join the two."""
    field = driver.find_element(By.ID, element_id)
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(value or Keys.DELETE)
    assert field.get_attribute("value") == value, (element_id, field.get_attribute("value"))


def send(driver: Any, text: str) -> None:
    set_field(driver, "chat-input", text)
    driver.find_element(By.ID, "chat-send").click()


def test_chat_streams_an_answer_with_speed(
    cluster: LocalCluster, page: Any, tmp_path: Path
) -> None:
    set_field(page, "chat-temperature", "0")
    set_field(page, "chat-max-tokens", str(MAX_TOKENS))
    send(page, QUESTION)
    seen = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        state = page.execute_script(READ_CHAT)
        seen.append(state)
        if state and state["state"] in ("done", "error"):
            break
        time.sleep(0.05)
    final = seen[-1]
    assert final and final["state"] == "done", final
    partial = [
        s
        for s in seen
        if s and s["state"] == "streaming" and 0 < len(s["text"]) < len(final["text"])
    ]
    assert partial, "never saw a partial answer while streaming"
    assert any("tok/s" in s["stats"] for s in partial), "no live tokens/s while streaming"
    assert float(final["tps"]) > 0 and "tok/s" in final["stats"]

    # the streamed text, assembled by the page, is the API's own greedy answer, and the token
    # count shown at the end is its usage
    status, reference = http_json(
        cluster.urls[0] + "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        },
        timeout=120,
    )
    assert status == 200
    assert final["text"] == reference["choices"][0]["message"]["content"]
    assert final["stats"].startswith(f"{reference['usage']['completion_tokens']} tokens")

    save_screenshot(page, [tmp_path / "web_ui.png", ARTIFACTS / "web_ui.png"])


def save_screenshot(driver: Any, paths: list[Path]) -> None:
    """The whole page: the window grows to the document's height first."""
    size = driver.get_window_size()
    inner, needed = driver.execute_script(
        "return [window.innerHeight, document.documentElement.scrollHeight]"
    )
    if needed > inner:
        driver.set_window_size(size["width"], size["height"] + needed - inner)
    try:
        for path in paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            assert driver.save_screenshot(str(path))
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        driver.set_window_size(size["width"], size["height"])


def chat_error(driver: Any) -> str:
    box = driver.find_element(By.ID, "chat-error")
    return box.text if box.is_displayed() else ""


def test_api_errors_show_in_the_page(cluster: LocalCluster, page: Any) -> None:
    body = {"model": "no-such-model", "messages": [{"role": "user", "content": QUESTION}]}
    status, expected = http_json(cluster.urls[1] + "/v1/chat/completions", body)
    assert status == 404
    set_field(page, "chat-model", "no-such-model")
    try:
        send(page, QUESTION)
        wait(page, chat_error, 20, "the API's error never showed in the page")
        assert expected["error"]["message"] in chat_error(page)
        assert "HTTP 404" in chat_error(page)
        assert page.execute_script(READ_CHAT)["state"] == "error"
        # the rejected message is back in the input, ready to retry
        assert page.find_element(By.ID, "chat-input").get_attribute("value") == QUESTION
    finally:
        set_field(page, "chat-model", MODEL)
        set_field(page, "chat-input", "")


def node_process(cluster: LocalCluster, node_id: str) -> psutil.Process:
    for child in psutil.Process(cluster.proc.pid).children():
        if node_id in child.cmdline():
            return child
    raise AssertionError(f"no process for {node_id}")


PICKER_ROWS = """
return [...document.querySelectorAll('#models tbody tr')].map((row) => ({
  model: row.dataset.model,
  serving: !!row.querySelector('.tag'),
  fits: row.querySelector('[data-field=fits]').textContent,
  button: !!row.querySelector('button'),
}));
"""


def picker_rows(driver: Any) -> list[dict[str, Any]]:
    return driver.execute_script(PICKER_ROWS)


def click(driver: Any, selector: str) -> None:
    """Click in one script: the table is redrawn on every poll, so a found element can go
    stale before a separate click reaches it."""
    driver.execute_script("document.querySelector(arguments[0]).click()", selector)


def serving_in_page(driver: Any, model: str) -> bool:
    return any(r["model"] == model and r["serving"] for r in picker_rows(driver))


READ_BALANCE = """
return [...document.querySelectorAll('#balance tbody tr')].map((tr) => ({...tr.dataset,
  share_text: tr.querySelector('[data-field=share]').textContent,
  speed_text: tr.querySelector('[data-field=speed]').textContent}));
"""


def test_balance_panel_shows_the_leaders_live_speeds(cluster: LocalCluster, page: Any) -> None:
    """While a stream runs, the page (served by a follower) shows each rank's live speed and
    held share exactly as the leader's /v1/cluster balance says."""
    leader = http_json(cluster.urls[0] + "/v1/cluster")[1]["leader"]
    leader_url = cluster.urls[int(leader.rsplit("-", 1)[1])]
    # a long stream keeps the ranks stepping (and probing); the test hangs up when it is done
    stream = LongStream(leader_url, MODEL).start()
    try:

        def agreeing(driver: Any) -> list[dict[str, Any]] | None:
            balance = http_json(leader_url + "/v1/cluster")[1]["balance"]
            rows = driver.execute_script(READ_BALANCE)
            ranks = balance["ranks"] if balance else []
            if not ranks or any(r["speed_bytes_per_second"] is None for r in ranks):
                return None
            same = [
                (row["node"], float(row["share"]), float(row["speed"]))
                for row in rows
                if row["speed"] and row["share"]
            ] == [(r["node_id"], r["share"], r["speed_bytes_per_second"]) for r in ranks]
            return rows if same else None

        rows = wait(page, agreeing, 120, "the balance panel never matched /v1/cluster")

        def probed_together(driver: Any) -> list[float] | None:
            """The ranks' latest samples, once all come from one probe round: the same tick of
            the PROBE_SECONDS grid (the ranks' heartbeats arrive apart, so the leader may hold
            one rank's sample of the next round beside its peers' of this one)."""
            ranks = http_json(leader_url + "/v1/cluster")[1]["balance"]["ranks"]
            times = sorted(r["sampled_at"] for r in ranks if r["sampled_at"] is not None)
            rounds = {math.floor(t / PROBE_SECONDS) for t in times}
            return times if len(times) == 3 and len(rounds) == 1 else None

        # every rank probes after the same step, so their noise is shared: within a step or
        # two of one another (a decode step here: ~0.1 s), not a rank's own timer apart
        together = wait(page, probed_together, 60, "the ranks never probed in one round")
        assert together[-1] - together[0] < 0.5, together
    finally:
        stream.stop()
    assert [row["node"] for row in rows] == plan_of(cluster.urls[0])["nodes"]
    assert sum(float(row["balanced"]) for row in rows) == pytest.approx(1.0)
    for row in rows:
        assert row["share_text"].endswith("%") and row["speed_text"].endswith("/s"), row


def test_model_picker_lists_loads_and_downloads(cluster: LocalCluster, page: Any) -> None:
    """The picker shows what /v1/models/catalog says, Load loads a model beside the one served
    (both resident: issue #59) and it is served, and a typed hub id shows its download's state
    and error in the page."""
    status, catalog = http_json(cluster.urls[1] + "/v1/models/catalog", timeout=30)
    assert status == 200, catalog
    expected = {m["name"]: m for m in catalog["models"]}
    assert {MODEL, "smollm2-135m-q4"} <= set(expected)
    wait(page, lambda d: {r["model"] for r in picker_rows(d)} == set(expected), 20, "no list")
    for row in picker_rows(page):
        want = expected[row["model"]]
        assert row["fits"] == (
            "?" if want["fits"] is None else "fits" if want["fits"] else "too big"
        )
        assert row["serving"] == want["loaded"] and row["button"] == (not want["loaded"])
    try:
        click(page, '#models tr[data-model="smollm2-135m-q4"] button')
        wait(page, lambda d: serving_in_page(d, "smollm2-135m-q4"), 120, "Load never loaded")
        assert serving_in_page(page, MODEL)  # resident beside it, not swapped out
        wait_ready(cluster.urls, nodes=3, logs=[cluster.log])
        for _ in range(240):  # its group serves once its ranks are ready
            status, answer = http_json(
                cluster.urls[0] + "/v1/completions",
                {"model": "smollm2-135m-q4", "prompt": "Hello", "max_tokens": 2},
                timeout=120,
            )
            if status != 503:
                break
            time.sleep(0.5)
        assert status == 200 and answer["model"] == "smollm2-135m-q4", answer
    finally:  # back to the one model the later tests expect
        http_json(cluster.urls[0] + "/v1/models/unload", {"model": "smollm2-135m-q4"})
        wait(page, lambda d: not serving_in_page(d, "smollm2-135m-q4"), 120, "never unloaded")
        wait_ready(cluster.urls, nodes=3, logs=[cluster.log])
    # No hub is reachable from these nodes: the typed id's download fails, and says why.
    set_field(page, "model-input", "tiny-org/absent")
    page.find_element(By.CSS_SELECTOR, "#model-form button").click()
    failed = '#models .download[data-model="tiny-org/absent"][data-state="failed"]'
    text = wait(
        page,
        lambda d: d.execute_script(
            "return document.querySelector(arguments[0])?.textContent", failed
        ),
        60,
        "no failed download",
    )
    assert "cannot reach the hub" in text
    # The API says the same, as a server-side failure (OpenAI's convention for a 5xx).
    status, error = http_json(
        cluster.urls[0] + "/v1/chat/completions",
        {"model": "tiny-org/absent", "messages": [{"role": "user", "content": "hi"}]},
        timeout=60,
    )
    assert status == 503 and error["error"]["type"] == "server_error", (status, error)
    assert "cannot reach the hub" in error["error"]["message"], error


def test_measured_fields_render(default_models: dict[str, Path], page: Any) -> None:
    """Fields the API adds once measured (device profiles, links, predicted speed, pipeline
    stages) are drawn when present: the page's own modules render a 5-device hybrid plan built
    by the planner, in the same browser."""
    spec = load_spec(default_models[MODEL])
    pipeline = plan_pipeline(spec, [[4, 3, 2], [2, 1]], [18, 12])
    nodes = ["a", "b", "c", "d", "e"]
    # exactly what /v1/plan sends for this plan, with the cost model's prediction
    devices = Cluster(
        devices=tuple(
            DeviceCost(
                name=n, seconds_per_byte=1 / (speed * 1e9), prefill_flops=1e12, memory=10**10
            )
            for n, speed in zip(nodes, [400, 300, 200, 200, 100], strict=True)
        )
    )
    prediction = predict(pipeline, range(5), devices)
    response = plan_view(
        pipeline, prediction, epoch=9, state="ready", model=MODEL, nodes=tuple(nodes)
    ).model_dump(mode="json")
    local = [
        (stage.ranks[i], shard)
        for stage in pipeline.stages
        for i, shard in enumerate(stage.tp.ranks)
    ]
    profile = {
        "chip": "Apple M2 Ultra",
        "cores": 24,
        "mlx_version": "0.32.4",
        "mlx_device": "gpu",
        "memory_total": 192e9,
        "memory_available": 150e9,
        "decode_seconds_per_byte": 1.25e-12,
        "prefill_flops": 2e13,
        "backends": ["ring"],
    }
    shapes = [{"dtype": "float32", "k": 576, "n": n, "seconds": 1e-5} for n in (192, 384, 576)] + [
        {"dtype": "q4g32", "k": 576, "n": 1536, "seconds": 1e-5}
    ]
    # which node holds which bytes of the model: "a" fetches its shard, "b" has the files
    progress = {
        "bytes_done": 12e9,
        "bytes_total": 30e9,
        "rate_bytes_s": 1.5e9,
        "eta_s": 12.0,
        "failed_sources": ["c"],
        "corrupt_pieces": 1,
    }
    weights = {
        "a": {
            "holds": "store",
            "held_bytes": 12e9,
            "total_bytes": 140e9,
            "fetch": {
                "epoch": 9,
                "state": "fetching",
                "share_bytes": 30e9,
                "retained_bytes": 0,
                "planned_bytes": 30e9,
                "progress": progress,
            },
        },
        "b": {"holds": "files", "held_bytes": 140e9, "total_bytes": 140e9, "fetch": None},
    }
    cluster_view = {
        "cluster": "lab",
        "node_id": "b",
        "leader": "a",
        "epoch": 9,
        "state": "ready",
        "state_reason": "",
        "backend": "ring",
        "ranks": nodes,
        "nodes": [
            {
                "node_id": n,
                "host": "10.0.0.1",
                "api_url": "http://10.0.0.1:8000",
                "alive": True,
                "leader": n == "a",
                "weight": 0,
                "memory_total": 0,
                "memory_available": 0,
                "decode_seconds_per_byte": 0,
                "prefill_flops": 0,
                "version": "0.1.0",
                "worker_state": "ready",
                # "a" measured the model's shapes (float32) and another model's (4-bit)
                "profile": {**profile, "shapes": shapes} if n == "a" else profile,
                "memory": {"total": 192e9, "available": 120e9, "used": 72e9, "worker_rss": 3e9},
                "weights": weights.get(n),
            }
            for n in nodes
        ],
        "links": [
            {
                "a": "a",
                "b": "b",
                "up": True,
                "all_sum_latency": 3e-4,
                "all_sum_bandwidth": 2.5e9,
                "send_recv_latency": 1e-4,
            },
            {"a": 3, "b": 4, "up": False},
        ],
        # probed as the nodes joined: what the leader planned with for this pair
        "measured_links": [
            {
                "a": "a",
                "b": "c",
                "up": True,
                "all_sum_latency": 5e-3,
                "all_sum_bandwidth": 1e6,
                "source": "probe",
                "measured_at": "2026-12-01T21:00:00+00:00",
            }
        ],
    }
    drawn = page.execute_async_script(
        """
        const [response, cluster, done] = arguments;
        Promise.all([import('/ui/layout.js'), import('/ui/topology.js')]).then(([l, t]) => {
          const layout = document.createElement('div');
          l.renderLayout(layout, response);
          const graph = document.createElementNS('http://www.w3.org/2000/svg', 'svg');
          t.renderGraph(graph, cluster);
          const cards = document.createElement('div');
          t.renderNodes(cards, cluster, response);
          done({predicted: l.predictedView(response).textContent,
                mode: layout.querySelector('.mode')?.textContent,
                stages: [...layout.querySelectorAll('[data-kind=stage]')].map(e => e.textContent),
                q_heads: [...layout.querySelectorAll('[data-kind=q_heads]')].map(
                  e => [e.dataset.rank, e.dataset.count]),
                replicated: [...layout.querySelectorAll('.kv-cell.replicated')].map(
                  e => e.textContent),
                edges: [...graph.querySelectorAll('.edge')].map(e => e.getAttribute('class')),
                probed: graph.querySelector('.edge[data-link="a|c"]').dataset.tip,
                labels: [...graph.querySelectorAll('.edge-label')].map(e => e.textContent),
                card: cards.querySelector('[data-node=a]').textContent,
                card_b: cards.querySelector('[data-node=b]').textContent,
                weights: [...cards.querySelectorAll('[data-field=weights]')].map(
                  e => e.textContent)});
        }).catch((error) => done({error: String(error)}));
    """,
        response,
        cluster_view,
    )
    assert "error" not in drawn, drawn
    assert drawn["predicted"] == f"{prediction.tokens_per_second:.1f} tok/s predicted"
    assert drawn["stages"] == ["stage 1 · layers 0–17", "stage 2 · layers 18–29"]
    # which of the three modes the model gets, and why (tensor-parallel / stages only / whole)
    assert drawn["mode"] == "tensor-parallel: llama has a tensor-parallel table", drawn["mode"]
    expected = [(str(rank), str(shard.heads.q_heads.size)) for rank, shard in local]
    assert sorted(map(tuple, drawn["q_heads"])) == sorted(expected)
    assert drawn["labels"] == ["300 µs · 2.50 GB/s", "down"]
    assert sum("measured" in c.split() for c in drawn["edges"]) == 2
    assert "probed when the node joined" in drawn["probed"], drawn["probed"]
    assert "2026-12-01T21:00:00+00:00" in drawn["probed"] and "5.00 ms" in drawn["probed"]
    assert sum("down" in c.split() for c in drawn["edges"]) == 1
    for text in (
        "Apple M2 Ultra",
        "24 cores",
        "72.0 GB / 192 GB",
        "3.00 GB RSS",
        "800 GB/s weights",
        "20.0 TFLOP/s",
    ):
        assert text in drawn["card"], (text, drawn["card"])
    assert "not measured" not in drawn["card"]
    # shares: "a" by the 3 shapes of this model's weight format, "b" by its decode score
    assert "from 3 measured matrix shapes" in drawn["card"], drawn["card"]
    assert "from decode score" in drawn["card_b"], drawn["card_b"]
    assert drawn["weights"] == [
        "fetching 12.0 GB / 30.0 GB · 1.50 GB/s · ETA 12.00 s",
        "files · all 140 GB",
    ]


READ_FINETUNE = """
const panel = document.getElementById('finetune-panel');
const points = (cls) => {
  const line = document.querySelector('#finetune polyline.' + cls);
  if (!line) return [];
  return line.getAttribute('points').trim().split(/\\s+/).map((p) => p.split(',').map(Number));
};
const svg = document.querySelector('#finetune svg');
return {hidden: panel.hidden, text: document.getElementById('finetune').textContent,
        status: (document.querySelector('#finetune [data-field=status]') || {}).textContent,
        box: svg ? svg.getAttribute('viewBox').split(' ').map(Number) : null,
        train: points('train-loss'), valid: points('valid-loss')};
"""
FT_STEPS = 3
FT_WORDS = "the sea is blue and the sky is wide a ship sails over the waves"


def chat_jsonl(count: int, seed: int) -> bytes:
    rng = random.Random(seed)
    words = FT_WORDS.split()
    rows = [
        {
            "messages": [
                {"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(3, 8)))},
                {"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(3, 9)))},
            ]
        }
        for _ in range(count)
    ]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def drawn_losses(
    points: list[list[float]], box: list[float], lo: float, hi: float, last: int
) -> list[tuple[float, float]]:
    """(step, loss) of each drawn point, read back through the chart's axes: steps 1..last
    across the width and losses lo..hi up the height, 4 px inside the box."""
    _, _, width, height = box
    return [
        (1 + (x - 4) / (width - 8) * (last - 1), lo + (height - 4 - y) / (height - 8) * (hi - lo))
        for x, y in points
    ]


def test_finetune_panel_shows_the_jobs_progress_and_losses(
    tmp_path: Path, default_models: dict[str, Path], browser: Any
) -> None:
    """A job on a 1-node cluster of a tiny random llama (cheap: ~30 s) through OpenAI's API:
    the panel shows its state and step as /v1/fine_tuning/jobs says, and its training and
    validation loss curves through the very points /events reports, read back from the
    drawing's geometry."""
    from arch_configs import tiny_config
    from openai import OpenAI
    from tiny_models import write_tiny_model

    model = write_tiny_model(tmp_path / "llama", tiny_config("llama"), default_models[MODEL])
    env = {"EXO_TP_HOME": str(tmp_path / "home")}
    with local_cluster(1, model=str(model), env=env) as running, own_tab(browser):
        browser.get(running.urls[0] + "/")
        api = OpenAI(base_url=f"{running.urls[0]}/v1", api_key="none", max_retries=0)
        train = api.files.create(file=("t.jsonl", chat_jsonl(2 * FT_STEPS, 0)), purpose="fine-tune")
        valid = api.files.create(file=("v.jsonl", chat_jsonl(2, 1)), purpose="fine-tune")
        job = api.fine_tuning.jobs.create(
            model=str(model),
            training_file=train.id,
            validation_file=valid.id,
            seed=0,
            hyperparameters={"n_epochs": 1, "batch_size": 2, "learning_rate_multiplier": 1000},
        )
        deadline = time.monotonic() + 120
        while api.fine_tuning.jobs.retrieve(job.id).status not in FINISHED_JOB:
            assert time.monotonic() < deadline, "the job never finished"
            time.sleep(0.5)
        done = api.fine_tuning.jobs.retrieve(job.id)
        assert done.status == "succeeded", done.error
        events = api.fine_tuning.jobs.list_events(job.id, limit=100).data[::-1]
        metrics = [e.data for e in events if e.type == "metrics"]
        train_losses = [
            (m["step"], m["train_loss"]) for m in metrics if m.get("train_loss") is not None
        ]
        valid_losses = [
            (m["step"], m["valid_loss"]) for m in metrics if m.get("valid_loss") is not None
        ]
        assert [s for s, _ in train_losses] == list(range(1, FT_STEPS + 1)) and valid_losses

        def finished(driver: Any) -> dict[str, Any] | None:
            shown = driver.execute_script(READ_FINETUNE)
            done = shown["status"] == "succeeded" and len(shown["train"]) == FT_STEPS
            return shown if done else None

        shown = wait(browser, finished, 20, "the panel never showed the finished job")
    assert not shown["hidden"]
    progress = done.model_extra["progress"]
    assert progress["step"] == progress["total_steps"] == FT_STEPS
    assert f"step {FT_STEPS} of {FT_STEPS}" in shown["text"]
    assert job.id in shown["text"] and done.fine_tuned_model in shown["text"]
    first, last = train_losses[0], train_losses[-1]
    label = f"training loss {first[1]:.3f} at step 1, {last[1]:.3f} at step {FT_STEPS}"
    assert label in shown["text"]
    losses = [loss for _, loss in train_losses + valid_losses]
    lo, hi = min(losses), max(losses)
    tolerance = 0.06 / (shown["box"][3] - 8) * (hi - lo) + 1e-9  # points drawn to 0.1 px
    for drawn, reported in ((shown["train"], train_losses), (shown["valid"], valid_losses)):
        back = drawn_losses(drawn, shown["box"], lo, hi, FT_STEPS)
        assert len(back) == len(reported)
        for (step, loss), (want_step, want_loss) in zip(back, reported, strict=True):
            assert abs(step - want_step) < 0.01 and abs(loss - want_loss) <= tolerance, (
                back,
                reported,
            )


def test_live_replan_and_lost_node(cluster: LocalCluster, page: Any) -> None:
    """Runs last. A node hangs mid-answer (SIGSTOP: `--local-nodes` would restart a node that
    exits): the stream's error event shows, the layout redraws for the re-plan over the
    two others; then the page's own node hangs: a banner says the page lost it."""
    before = plan_of(cluster.urls[1])
    frozen: list[psutil.Process] = []
    try:
        set_field(page, "chat-max-tokens", "400")
        send(page, "Write a long story about a lighthouse keeper.")
        wait(
            page,
            lambda d: (d.execute_script(READ_CHAT) or {}).get("state") == "streaming",
            60,
            "the long answer never started",
        )
        leaving = before["nodes"][2]
        frozen.append(node_process(cluster, leaving))
        frozen[-1].suspend()

        wait(page, chat_error, 30, "the interrupted stream's error never showed")
        assert "generation failed" in chat_error(page), chat_error(page)

        def replanned(driver: Any) -> dict[str, Any] | None:
            epoch = shown_plan_epoch(driver)
            if not epoch or int(epoch) <= before["epoch"]:
                return None
            response = plan_of(cluster.urls[1])
            return response if str(response["epoch"]) == epoch else None

        after = wait(page, replanned, 90, "the page never showed the new plan")
        assert len(after["nodes"]) == 2 and leaving not in after["nodes"]
        assert_layout_matches(page, after)
        note = page.find_element(By.ID, "layout-note").text
        assert f"epoch {before['epoch']} → {after['epoch']}" in note
        wait(
            page,
            lambda d: (
                d.find_element(By.CSS_SELECTOR, f'#nodes [data-node="{leaving}"]').get_attribute(
                    "data-alive"
                )
                == "false"
            ),
            10,
            "the hung node still looks alive",
        )

        frozen.append(node_process(cluster, "local-1"))  # the node serving the page
        frozen[-1].suspend()
        banner = page.find_element(By.ID, "banner")
        wait(
            page,
            lambda d: banner.is_displayed() and "cannot reach this node" in banner.text,
            20,
            "losing the node did not show in the page",
        )
    finally:
        for process in frozen:
            process.resume()
