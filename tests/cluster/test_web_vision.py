"""Images in the web UI's chat (issue #58), in a real headless Chromium against 3 local nodes
(shares 5, 3, 1) serving the tiny Qwen 3.5 vision checkpoint of tests/vlm_models.py.

An image attached with the file picker or pasted into the message box shows as a removable
thumbnail, then in the user's turn; the page sends it as an OpenAI image part before the text,
keeps it in the history of later turns, and shows the answer single-device mlx-vlm gives (and
the API itself, for the very body the page sent). A bad image is the API's 400, shown in the
page; a large photo is re-encoded under the API's body limit. A text-only model offers no
attach button and leaves a pasted image out, saying so.
"""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import LocalCluster, http_json, local_cluster

pytest.importorskip("mlx_vlm", reason="mlx-vlm is not installed (.ci/install installs it)")
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from test_web_ui import (  # noqa: E402
    CHROME_FLAGS,
    CHROMEDRIVER,
    CHROMIUM,
    READ_CHAT,
    chat_error,
    own_tab,
    send,
    set_field,
    wait,
)
from vlm_models import PROMPT, TOKENS, gradient, greedy, greedy_text, write_tiny_vlm  # noqa: E402

pytestmark = [
    pytest.mark.skipif(
        CHROMIUM is None or CHROMEDRIVER is None,
        reason="needs Debian's chromium and chromium-driver (.ci/install installs them)",
    ),
    pytest.mark.filterwarnings("ignore:At least one mel filter:UserWarning"),
]

ANSWER_TIMEOUT = 120  # a few prompt and 16 decode steps on 3 ranks of a loaded 2-core box
# The chat requests the page makes, recorded as sent (api.js calls the global fetch).
RECORD_REQUESTS = """
window.sentBodies = [];
const original = window.fetch;
window.fetch = (url, init) => {
  if (String(url).endsWith('/v1/chat/completions')) window.sentBodies.push(JSON.parse(init.body));
  return original(url, init);
};
"""
PASTE = """
const [b64, name, type] = arguments;
const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
const data = new DataTransfer();
data.items.add(new File([bytes], name, {type}));
document.getElementById('chat-input').dispatchEvent(
  new ClipboardEvent('paste', {clipboardData: data, bubbles: true, cancelable: true}));
"""
READ_IMAGES = """
const srcs = (selector) => [...document.querySelectorAll(selector)].map((img) => img.src);
const users = document.querySelectorAll('#messages .message.user');
const last = users[users.length - 1];
return {pending: srcs('#chat-attachments img'),
        strip_shown: !document.getElementById('chat-attachments').hidden,
        sent: last ? [...last.querySelectorAll('.images img')].map((img) => img.src) : [],
        note: document.getElementById('chat-note').hidden ? ''
          : document.getElementById('chat-note').textContent};
"""


def png(image: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


class Served:
    """The cluster and single-device mlx-vlm on the same checkpoint."""

    def __init__(self, cluster: LocalCluster, folder: Path):
        from mlx_lm.tokenizer_utils import load as load_tokenizer
        from mlx_vlm import load

        self.cluster, self.folder = cluster, folder
        self.model, self.processor = load(str(folder))
        self.tokenizer = load_tokenizer(folder)

    def text(self, tokens: list[int]) -> str:
        """The API's answer text for ``tokens`` (mlx-lm's streaming detokenizer, which drops
        the answer's leading space as mlx_lm.server does; mlx-vlm's keeps it)."""
        detokenizer = self.tokenizer.detokenizer
        detokenizer.reset()
        for token in tokens:
            detokenizer.add_token(token)
        detokenizer.finalize()
        return detokenizer.text


@pytest.fixture(scope="module")
def served(
    default_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("vlm") / "qwen3_5"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_OFFLINE", "1")  # the processors read the folder, never the hub
        write_tiny_vlm(folder, "qwen3_5", default_models["smollm2-135m"])
        with local_cluster(3, weights=[5, 3, 1], model=str(folder)) as cluster:
            yield Served(cluster, folder)


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
def vision_page(served: Served, browser: Any) -> Any:
    """The UI of a node that is not the leader, greedy and 16 tokens (as the references)."""
    browser.get(served.cluster.urls[1] + "/")
    browser.execute_script(RECORD_REQUESTS)
    wait(browser, offered, 30, "the page never offered to attach an image")
    set_field(browser, "chat-temperature", "0")
    set_field(browser, "chat-max-tokens", str(TOKENS))
    return browser


@pytest.fixture
def page(vision_page: Any) -> Iterator[Any]:
    """An empty conversation and nothing attached, before and after each test."""

    def reset() -> None:
        vision_page.find_element(By.ID, "chat-clear").click()
        vision_page.execute_script(
            "window.sentBodies = [];"
            "document.querySelectorAll('#chat-attachments .thumb-remove')"
            ".forEach((b) => b.click());"
        )
        set_field(vision_page, "chat-input", "")

    reset()
    yield vision_page
    reset()


def offered(driver: Any) -> bool:
    return driver.find_element(By.ID, "chat-attach").is_displayed()


def images(driver: Any) -> dict[str, Any]:
    return driver.execute_script(READ_IMAGES)


def attach(driver: Any, path: Path) -> None:
    """Through the file picker's input, as a user's choice in the dialog sets it."""
    before = len(images(driver)["pending"])
    driver.find_element(By.ID, "chat-file").send_keys(str(path))
    wait(driver, lambda d: len(images(d)["pending"]) > before, 20, "no thumbnail for the file")


def paste(driver: Any, data: bytes, name: str = "pasted.png", kind: str = "image/png") -> None:
    driver.execute_script(PASTE, base64.b64encode(data).decode(), name, kind)


def answer(driver: Any, turns: int) -> dict[str, Any]:
    """The ``turns``-th answer once it is complete."""

    def complete(d: Any) -> dict[str, Any] | None:
        count = d.execute_script("return document.querySelectorAll('#messages .assistant').length")
        state = d.execute_script(READ_CHAT)
        return state if count == turns and state["state"] in ("done", "error") else None

    final = wait(driver, complete, ANSWER_TIMEOUT, "the answer never completed")
    assert final["state"] == "done", (final, chat_error(driver))
    return final


def sent(driver: Any) -> list[dict[str, Any]]:
    return driver.execute_script("return window.sentBodies")


def api_answer(served: Served, body: dict[str, Any]) -> str:
    """The API's own answer to the page's request, not streamed."""
    plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    status, reply = http_json(served.cluster.urls[0] + "/v1/chat/completions", plain, timeout=300)
    assert status == 200, reply
    return reply["choices"][0]["message"]["content"]


def unaddressed(text: str) -> str:
    return re.sub(r" at 0x[0-9a-f]+", "", text)


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def test_a_picked_image_is_sent_before_the_text_and_answered_as_mlx_vlm(
    served: Served, page: Any, tmp_path: Path
) -> None:
    one, two = tmp_path / "one.png", tmp_path / "two.png"
    one.write_bytes(png(gradient(1)))
    two.write_bytes(png(gradient(2)))
    attach(page, two)
    attach(page, one)
    assert images(page)["pending"] == [data_url(two.read_bytes()), data_url(one.read_bytes())]
    # removable before sending: the first thumbnail's button takes it away
    page.find_element(By.CSS_SELECTOR, "#chat-attachments .thumb-remove").click()
    shown = images(page)
    assert shown["pending"] == [data_url(one.read_bytes())] and shown["strip_shown"]

    send(page, PROMPT)
    final = answer(page, 1)
    shown = images(page)
    assert shown["sent"] == [data_url(one.read_bytes())], shown
    assert shown["pending"] == [] and not shown["strip_shown"]

    [body] = sent(page)
    url = data_url(one.read_bytes())
    assert body["messages"] == [
        {"role": "user", "content": [image_part(url), {"type": "text", "text": PROMPT}]}
    ]
    assert (body["max_tokens"], body["temperature"]) == (TOKENS, 0)
    expected = served.text(greedy(served.model, served.processor, gradient(1)))
    assert final["text"] == expected and expected.strip()
    assert api_answer(served, body) == expected


def test_pasted_images_stay_in_the_history_of_later_turns(served: Served, page: Any) -> None:
    first, second = png(gradient(3)), png(gradient(4))
    paste(page, first)
    wait(page, lambda d: len(images(d)["pending"]) == 1, 20, "no thumbnail for the paste")
    send(page, PROMPT)
    said = answer(page, 1)["text"]
    paste(page, second)
    wait(page, lambda d: len(images(d)["pending"]) == 1, 20, "no thumbnail for the 2nd paste")
    send(page, "More?")
    final = answer(page, 2)
    assert images(page)["sent"] == [data_url(second)]
    assert len(page.find_elements(By.CSS_SELECTOR, "#messages .message.user .images img")) == 2

    body = sent(page)[-1]
    assert body["messages"] == [
        {
            "role": "user",
            "content": [image_part(data_url(first)), {"type": "text", "text": PROMPT}],
        },
        {"role": "assistant", "content": said},
        {
            "role": "user",
            "content": [image_part(data_url(second)), {"type": "text", "text": "More?"}],
        },
    ]
    assert final["text"] == api_answer(served, body)
    rendered = served.processor.tokenizer.apply_chat_template(
        [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]},
            {"role": "assistant", "content": said},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "More?"}]},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    tokens = greedy_text(served.model, served.processor, rendered, [gradient(3), gradient(4)])
    assert final["text"] == served.text(tokens)


def test_a_bad_image_shows_the_apis_400(served: Served, page: Any, tmp_path: Path) -> None:
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not a picture")
    attach(page, bad)
    url = data_url(bad.read_bytes())
    message = {"role": "user", "content": [image_part(url), {"type": "text", "text": PROMPT}]}
    status, expected = http_json(
        served.cluster.urls[1] + "/v1/chat/completions",
        {"messages": [message], "max_tokens": TOKENS, "temperature": 0},
        timeout=60,
    )
    assert status == 400, expected
    send(page, PROMPT)
    wait(page, chat_error, 30, "the API's error never showed in the page")
    # (Pillow's reason names its buffer's address, which differs between the two requests)
    assert unaddressed(expected["error"]["message"]) in unaddressed(chat_error(page))
    assert "HTTP 400" in chat_error(page)
    assert page.execute_script(READ_CHAT)["state"] == "error"
    assert sent(page)[-1]["messages"] == [message]
    # nothing was answered: the message and its image are back, ready to retry as they were
    assert page.find_element(By.ID, "chat-input").get_attribute("value") == PROMPT
    assert images(page)["pending"] == [url]


def test_a_large_photo_is_reencoded_under_the_body_limit(page: Any, tmp_path: Path) -> None:
    import numpy as np
    from PIL import Image

    # a photo's grain on a smooth picture: a PNG of several MB, which JPEG makes far smaller
    grain = np.random.default_rng(0).integers(-12, 13, (1500, 2000, 3))
    pixels = np.asarray(gradient(1, 2000, 1500), dtype=np.int64) + grain
    photo = tmp_path / "photo.png"
    photo.write_bytes(png(Image.fromarray(pixels.clip(0, 255).astype(np.uint8))))
    as_is = len(data_url(photo.read_bytes()))
    assert as_is > 4 * 1024 * 1024  # several MB as it is: worth re-encoding before it travels
    attach(page, photo)
    [url] = images(page)["pending"]
    assert url.startswith("data:image/jpeg;base64,") and len(url) < as_is // 4, len(url)
    data = base64.b64decode(url.split(",", 1)[1])
    assert Image.open(io.BytesIO(data)).size == (1600, 1200)  # the longest side at 1600


def test_the_layout_says_where_the_vision_tower_runs(served: Served, vision_page: Any) -> None:
    """The cluster view names the rank and node holding the tower, as the plan places it (the
    first stage's first rank) and sizes it (the checkpoint's tensors outside its language
    model, read here from the files themselves)."""
    import json as json_module

    plan = http_json(f"{served.cluster.urls[0]}/v1/cluster")[1]
    header = (served.folder / "model.safetensors").read_bytes()
    size = int.from_bytes(header[:8], "little")
    tensors = json_module.loads(header[8 : 8 + size])
    tower = sum(
        t["data_offsets"][1] - t["data_offsets"][0]
        for name, t in tensors.items()
        if name != "__metadata__" and not name.startswith("language_model.")
    )

    def line(d: Any) -> Any:
        found = d.find_elements(By.CSS_SELECTOR, "#layout [data-tower]")
        return found[0] if found else None

    shown = wait(vision_page, line, 30, "the layout never showed the vision tower")
    assert shown.get_attribute("data-tower") == "0"
    assert "vision tower: whole on" in shown.text and "(rank 0)" in shown.text
    assert f"{tower / 1e6:.2f} MB" in shown.text or f"{tower / 1e3:.0f} KB" in shown.text, (
        shown.text,
        tower,
        plan.get("plan", {}),
    )


def test_a_text_model_offers_no_images(tiny_smollm2: Path, browser: Any) -> None:
    with local_cluster(1, model=str(tiny_smollm2)) as cluster, own_tab(browser):
        status, models = http_json(cluster.urls[0] + "/v1/models")
        assert status == 200 and all("capabilities" not in m for m in models["data"]), models
        browser.get(cluster.urls[0] + "/")
        # the model field is filled in the same poll that read /v1/models
        wait(
            browser,
            lambda d: d.find_element(By.ID, "chat-model").get_attribute("value"),
            30,
            "the page never showed the served model",
        )
        assert not offered(browser)
        assert not browser.find_element(By.ID, "chat-file").is_enabled()
        paste(browser, png(gradient(1)))
        shown = images(browser)
        assert shown["pending"] == [] and not shown["strip_shown"], shown
        assert "does not take images" in shown["note"], shown
