"""Image URLs through a cluster (issue #58, exo_tp/api/core/image_fetch.py): nodes started with
`--image-urls --image-url-allow-network 127.0.0.1/32` fetch an image from an HTTP server on
that loopback address and answer exactly as for the same image sent inline (OpenAI, Anthropic,
Responses); the same server reached at 127.0.0.2 (loopback, outside the allowance), a redirect
from the allowed server to it, the cloud metadata address and a 404 are each a 400 naming the
part, in each dialect's error shape; and the cluster serves on."""

from __future__ import annotations

import base64
import http.server
import io
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from cluster_helpers import LocalCluster, http_json, local_cluster
from openai import OpenAI

pytest.importorskip("mlx_vlm", reason="mlx-vlm is not installed (.ci/install installs it)")
from vlm_models import PROMPT, TOKENS, gradient, write_tiny_vlm  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:At least one mel filter:UserWarning")
ALLOWED, OUTSIDE = "127.0.0.1", "127.0.0.2"  # both loopback; only the first is allowed


def _png(shade: int) -> bytes:
    out = io.BytesIO()
    gradient(shade).save(out, format="PNG")
    return out.getvalue()


class ImageServer:
    """/cat.png (gradient 4) on ``host``; /to-outside redirects to the other server's."""

    def __init__(self, host: str):
        self.requests = 0
        self.redirect = ""
        served = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                served.requests += 1
                if self.path == "/to-outside":
                    self.send_response(302)
                    self.send_header("Location", served.redirect)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.path != "/cat.png":
                    self.send_error(404, "Not Found")
                    return
                body = _png(4)
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer((host, 0), Handler)
        self.httpd.daemon_threads = True
        self.base = f"http://{host}:{self.httpd.server_address[1]}"
        serve = lambda: self.httpd.serve_forever(poll_interval=0.01)  # noqa: E731
        threading.Thread(target=serve, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[ImageServer, ImageServer]]:
    allowed, outside = ImageServer(ALLOWED), ImageServer(OUTSIDE)
    allowed.redirect = f"{outside.base}/cat.png"
    yield allowed, outside
    allowed.close()
    outside.close()


@pytest.fixture(scope="module")
def cluster(
    default_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    folder = tmp_path_factory.mktemp("vlm") / "qwen3_5"
    flags = ("--image-urls", "--image-url-allow-network", f"{ALLOWED}/32")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_OFFLINE", "1")  # the processors read the folder, never the hub
        write_tiny_vlm(folder, "qwen3_5", default_models["smollm2-135m"])
        with local_cluster(2, model=str(folder), extra=(*flags, "--image-url-timeout", "5")) as c:
            yield c


def _chat(client: OpenAI, url: str) -> tuple[list[int], str]:
    """The answer's token ids and text for the image at ``url`` and the prompt."""
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": PROMPT}]
    reply = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": content}],  # type: ignore[misc, list-item]
        max_tokens=TOKENS,
        temperature=0,
        logprobs=True,
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content
    ids = [entry.id for entry in logprobs.content]  # type: ignore[attr-defined]
    return ids, reply.choices[0].message.content or ""


def test_an_allowed_url_answers_as_the_same_image_inline(
    cluster: LocalCluster, servers: tuple[ImageServer, ImageServer]
) -> None:
    allowed, _ = servers
    inline = "data:image/png;base64," + base64.b64encode(_png(4)).decode()
    openai = OpenAI(base_url=f"{cluster.urls[1]}/v1", api_key="unused", max_retries=0, timeout=300)
    expected, text = _chat(openai, inline)
    before = allowed.requests
    assert _chat(openai, f"{allowed.base}/cat.png") == (expected, text)
    assert allowed.requests == before + 1
    reply = openai.responses.create(
        model="m",
        input=[  # type: ignore[list-item]
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": f"{allowed.base}/cat.png"},
                    {"type": "input_text", "text": PROMPT},
                ],
            }
        ],
        max_output_tokens=TOKENS,
        temperature=0,
    )
    assert reply.output_text == text
    claude = anthropic.Anthropic(base_url=cluster.urls[0], api_key="unused", max_retries=0)
    image = {"type": "image", "source": {"type": "url", "url": f"{allowed.base}/cat.png"}}
    said = claude.messages.create(
        model="m",
        max_tokens=TOKENS,
        messages=[{"role": "user", "content": [image, {"type": "text", "text": PROMPT}]}],  # type: ignore[list-item, misc]
        extra_body={"temperature": 0},
    )
    assert "".join(b.text for b in said.content if b.type == "text") == text


REFUSED = [
    ("outside the allowance", "{outside}/cat.png", "127.0.0.2 is a non-public address (loopback)"),
    ("redirected outside", "{allowed}/to-outside", "127.0.0.2 is a non-public address (loopback)"),
    ("metadata", "http://169.254.169.254/latest/meta-data/", "(link-local)"),
    ("not found", "{allowed}/dog.png", "answered HTTP 404"),
]


@pytest.mark.parametrize(("what", "url", "words"), REFUSED, ids=[r[0] for r in REFUSED])
def test_a_refused_url_is_a_400_naming_its_part_in_each_dialect(
    cluster: LocalCluster,
    servers: tuple[ImageServer, ImageServer],
    what: str,
    url: str,
    words: str,
) -> None:
    allowed, outside = servers
    url = url.format(allowed=allowed.base, outside=outside.base)
    seen = outside.requests
    look = {"type": "text", "text": "Look:"}
    bodies = {
        "/v1/chat/completions": {"type": "image_url", "image_url": {"url": url}},
        "/v1/messages": {"type": "image", "source": {"type": "url", "url": url}},
        "/v1/responses": {"type": "input_image", "image_url": url},
    }
    for route, part in bodies.items():
        text = {"type": "input_text", "text": "Look:"} if route == "/v1/responses" else look
        message = {"role": "user", "content": [text, part]}
        body: dict[str, Any] = {"model": "m", "max_tokens": 1, "messages": [message]}
        if route == "/v1/responses":
            body = {"model": "m", "max_output_tokens": 16, "input": [message]}
        code, reply = http_json(f"{cluster.urls[0]}{route}", body, timeout=60)
        assert code == 400, (route, reply)
        error = reply["error"]
        assert words in error["message"] and "Invalid image at" in error["message"], reply
        if route == "/v1/messages":  # Anthropic's shape: a type, no param
            assert reply["type"] == "error" and error["type"] == "invalid_request_error", reply
        else:
            assert error["param"].endswith("content[1]") and error["code"] == "invalid_image"
    assert outside.requests == seen  # nothing ever reached the address outside the allowance


def test_the_cluster_serves_on_after_refusals(cluster: LocalCluster) -> None:
    code, reply = http_json(
        f"{cluster.urls[0]}/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        timeout=120,
    )
    assert code == 200 and reply["choices"][0]["message"]["content"] is not None, reply
