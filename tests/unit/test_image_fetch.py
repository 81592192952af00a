"""Image URLs fetched for requests (exo_tp/api/core/image_fetch.py, issue #58): the address
guard over every kind of non-public address (literal, spelled oddly, inside IPv6, or behind a
name); then a fetch from a local HTTP(S) server on loopback, reachable only through the
operator's allowance (--image-url-allow-network): the host resolved once and the connection
pinned to the checked address (Host header, SNI and certificate name kept), each redirect hop
checked again, the byte limit, the deadline (a stalled server and a dripping one), HTTP errors,
and read_images' 400 naming the part."""

from __future__ import annotations

import http.server
import io
import ipaddress
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from exo_tp.api.core import image_fetch
from exo_tp.api.core.conversation import ImagePart, Message, TextPart
from exo_tp.api.core.errors import ApiError
from exo_tp.api.core.image_fetch import (
    FetchRefused,
    ImageUrlPolicy,
    address_refusal,
    fetch_image,
    fetch_images,
)
from exo_tp.api.core.images import read_images

LOOPBACK = ImageUrlPolicy(enabled=True, allow_networks=("127.0.0.1/32",), timeout=5.0)
BIG = 3 * 1024 * 1024


def _png() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 6), (200, 30, 40)).save(out, format="PNG")
    return out.getvalue()


PNG = _png()


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("127.0.0.1", "loopback"),
        ("127.255.0.9", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback (as IPv6)"),
        ("::ffff:10.1.2.3", "private (as IPv6)"),
        ("2002:7f00:1::", "loopback (as IPv6)"),  # 6to4 of 127.0.0.1
        ("64:ff9b::a9fe:a9fe", "link-local (as IPv6)"),  # NAT64 of 169.254.169.254
        ("10.0.0.1", "private"),
        ("172.16.5.4", "private"),
        ("192.168.1.1", "private"),
        ("169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("fc00::1", "private"),
        ("fd12:3456::1", "private"),
        ("100.64.0.1", "shared (CGNAT)"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("239.255.255.250", "multicast"),
        ("ff02::1", "multicast"),
        ("240.0.0.1", "private"),  # reserved (Python counts 240/4 as private)
        ("255.255.255.255", "private"),
        ("192.0.2.7", "private"),  # documentation
        ("198.18.0.1", "private"),  # benchmarking
        ("2001:db8::1", "private"),  # documentation
        ("::7f00:1", "reserved"),  # IPv4-compatible (deprecated)
        ("fec0::1", "site-local"),
    ],
)
def test_non_public_addresses_are_refused(address: str, kind: str) -> None:
    assert address_refusal(ipaddress.ip_address(address), ImageUrlPolicy()) == kind


@pytest.mark.parametrize(
    "address", ["8.8.8.8", "93.184.216.34", "2606:4700:4700::1111", "::ffff:8.8.8.8"]
)
def test_global_addresses_are_allowed(address: str) -> None:
    assert address_refusal(ipaddress.ip_address(address), ImageUrlPolicy()) is None


def test_an_allowed_network_is_fetched_from_and_no_other() -> None:
    policy = ImageUrlPolicy(enabled=True, allow_networks=("192.168.1.7/24",))
    assert policy.allow_networks == ("192.168.1.0/24",)
    assert address_refusal(ipaddress.ip_address("192.168.1.20"), policy) is None
    assert address_refusal(ipaddress.ip_address("::ffff:192.168.1.20"), policy) is None
    assert address_refusal(ipaddress.ip_address("192.168.2.20"), policy) == "private"
    assert address_refusal(ipaddress.ip_address("127.0.0.1"), policy) == "loopback"


ANY_PUBLIC = ImageUrlPolicy(enabled=True)


def _refusal(url: str, policy: ImageUrlPolicy = ANY_PUBLIC) -> str:
    with pytest.raises(FetchRefused) as caught:
        fetch_image(url, policy)
    return str(caught.value)


Resolver = Callable[..., list[Any]]


def _fake_dns(names: dict[str, list[str]], calls: list[str] | None = None) -> Resolver:
    """getaddrinfo answering ``names`` (each with its addresses), counting lookups."""

    def resolve(host: str, port: int, *args: Any, **kwargs: Any) -> list[Any]:
        if calls is not None:
            calls.append(host)
        try:
            ipaddress.ip_address(host)
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (host, port))]  # a literal
        except ValueError:
            pass
        if host not in names:
            raise socket.gaierror(socket.EAI_NONAME, "unknown")
        return [
            (socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))
            for a in names[host]
        ]

    return resolve


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("http://127.0.0.1/x.png", "127.0.0.1 is a non-public address (loopback)"),
        ("http://127.1/x.png", "127.1 resolves to a non-public address (loopback)"),
        ("http://2130706433/x.png", "(loopback)"),  # 127.0.0.1 as one number
        ("http://0x7f000001/x.png", "(loopback)"),
        ("http://[::1]:8080/x.png", "(loopback)"),
        ("http://[::ffff:127.0.0.1]/x.png", "(loopback (as IPv6))"),
        ("http://10.0.0.1/x.png", "(private)"),
        ("https://169.254.169.254/latest/meta-data/", "(link-local)"),
        ("http://[fe80::1]/x.png", "(link-local)"),
        ("http://[fc00::1]/x.png", "(private)"),
        ("http://100.64.0.1/x.png", "(shared (CGNAT))"),
        ("http://0.0.0.0/x.png", "(unspecified)"),
        ("http://224.0.0.1/x.png", "(multicast)"),
        ("http://localhost/x.png", "localhost resolves to a non-public address (loopback)"),
    ],
)
def test_urls_reaching_non_public_addresses_are_refused_before_connecting(
    url: str, words: str
) -> None:
    assert words in _refusal(url)


def test_a_name_resolving_to_loopback_or_mixing_public_and_private_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    names = {"inside.test": ["127.0.0.1"], "both.test": ["93.184.216.34", "10.0.0.5"]}
    monkeypatch.setattr(image_fetch, "getaddrinfo", _fake_dns(names))
    assert "inside.test resolves to a non-public address (loopback)" in _refusal(
        "http://inside.test/cat.png"
    )
    assert "(private)" in _refusal("https://both.test/cat.png")  # every address is checked
    assert "could not be resolved" in _refusal("http://nowhere.test/cat.png")


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("ftp://example.com/cat.png", "only http and https"),
        ("file:///etc/passwd", "only http and https"),
        ("gopher://127.0.0.1:70/", "only http and https"),
        ("http:///cat.png", "no host"),
        ("http://example.com:99999/cat.png", "port"),
    ],
)
def test_other_schemes_and_bad_urls_are_refused(url: str, words: str) -> None:
    assert words in _refusal(url)


def test_nothing_is_fetched_while_the_policy_is_off() -> None:
    assert "not fetched" in _refusal("http://127.0.0.1/x.png", ImageUrlPolicy())


class Server:
    """A local HTTP(S) server on loopback; what it saw of each request."""

    def __init__(self, tls: ssl.SSLContext | None = None):
        self.release = threading.Event()  # set at the end: handlers that wait end
        self.hosts: list[str] = []
        self.sni: list[str | None] = []
        served = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                served.hosts.append(self.headers.get("Host", ""))
                route = ROUTES.get(self.path.split("?")[0])
                if route is None:
                    self.send_error(404, "Not Found")
                    return
                route(self, served)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        if tls is not None:
            tls.sni_callback = lambda sock, name, ctx: self.sni.append(name)  # type: ignore[assignment]
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        # (a short poll: shutdown() waits for the loop to see it)
        serve = lambda: self.httpd.serve_forever(poll_interval=0.01)  # noqa: E731
        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1", scheme: str = "http") -> str:
        return f"{scheme}://{host}:{self.port}{path}"

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def _send(handler: http.server.BaseHTTPRequestHandler, body: bytes, length: bool = True) -> None:
    handler.send_response(200)
    handler.send_header("Content-Type", "image/png")
    if length:
        handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def _redirect(to: str) -> Callable[[http.server.BaseHTTPRequestHandler, Server], None]:
    def route(handler: http.server.BaseHTTPRequestHandler, server: Server) -> None:
        handler.send_response(302)
        handler.send_header("Location", to.replace("PORT", str(server.port)))
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    return route


def _stream(handler: http.server.BaseHTTPRequestHandler, server: Server) -> None:
    """A body without Content-Length (to the connection's end), past any limit."""
    handler.send_response(200)
    handler.end_headers()
    try:
        for _ in range(BIG // 65536 + 1):
            handler.wfile.write(b"\0" * 65536)
    except OSError:
        pass  # the client stopped reading at its limit


def _stall(handler: http.server.BaseHTTPRequestHandler, server: Server) -> None:
    server.release.wait()


def _drip(handler: http.server.BaseHTTPRequestHandler, server: Server) -> None:
    """A byte at a time, each well within any read's timeout: only the deadline ends it."""
    handler.send_response(200)
    handler.send_header("Content-Length", "100000")
    handler.end_headers()
    try:
        while not server.release.wait(0.05):
            handler.wfile.write(b"\0")
            handler.wfile.flush()
    except OSError:
        pass  # the client hung up at its deadline


def _short(handler: http.server.BaseHTTPRequestHandler, server: Server) -> None:
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(PNG) + 100))
    handler.end_headers()
    handler.wfile.write(PNG)
    handler.close_connection = True


ROUTES: dict[str, Callable[[http.server.BaseHTTPRequestHandler, Server], None]] = {
    "/cat.png": lambda handler, server: _send(handler, PNG),
    "/cat-no-length.png": lambda handler, server: _send(handler, PNG, length=False),
    "/text": lambda handler, server: _send(handler, b"hello, not an image"),
    "/big": lambda handler, server: _send(handler, b"\0" * BIG),
    "/stream": _stream,
    "/stall": _stall,
    "/drip": _drip,
    "/short": _short,
    "/to-cat": _redirect("/cat.png"),
    "/to-loopback": _redirect("http://127.0.0.2:PORT/cat.png"),
    "/to-metadata": _redirect("http://169.254.169.254/latest/meta-data/"),
    "/to-localhost": _redirect("http://localhost:PORT/cat.png"),
    "/to-rebind": _redirect("http://rebind.test:PORT/cat.png"),
    "/to-file": _redirect("file:///etc/passwd"),
    "/loop": _redirect("/loop"),
    "/no-location": lambda handler, server: handler.send_error(302, "Found"),
}


@pytest.fixture
def server() -> Iterator[Server]:
    served = Server()
    yield served
    served.close()


def test_the_allowed_loopback_server_serves_and_the_default_policy_refuses_it(
    server: Server,
) -> None:
    assert fetch_image(server.url("/cat.png"), LOOPBACK) == PNG
    assert fetch_image(server.url("/cat-no-length.png"), LOOPBACK) == PNG
    assert "(loopback)" in _refusal(server.url("/cat.png"))
    assert server.hosts == [f"127.0.0.1:{server.port}"] * 2  # the refused one never connected


def test_the_name_is_resolved_once_and_kept_in_the_host_header(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DNS rebinding: a name that answers a public address first and a private one next gets
    no second lookup; the connection goes to the address that was checked."""
    calls: list[str] = []
    resolver = _fake_dns({"images.test": ["127.0.0.1"]}, calls)
    monkeypatch.setattr(image_fetch, "getaddrinfo", resolver)
    assert fetch_image(server.url("/cat.png", host="images.test"), LOOPBACK) == PNG
    assert calls == ["images.test"]
    assert server.hosts == [f"images.test:{server.port}"]


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("/to-loopback", "127.0.0.2 is a non-public address (loopback)"),
        ("/to-metadata", "169.254.169.254 is a non-public address (link-local)"),
        ("/to-localhost", "localhost resolves to a non-public address (loopback)"),  # ::1 too
        ("/to-rebind", "rebind.test resolves to a non-public address (private)"),
        ("/to-file", "only http and https"),
        ("/loop", "more than 3 redirects"),
        ("/no-location", "has no Location"),
    ],
)
def test_each_redirect_hop_is_checked(
    server: Server, monkeypatch: pytest.MonkeyPatch, path: str, words: str
) -> None:
    names = {"rebind.test": ["10.0.0.1"], "localhost": ["127.0.0.1", "::1"]}
    monkeypatch.setattr(image_fetch, "getaddrinfo", _fake_dns(names))
    assert words in _refusal(server.url(path), LOOPBACK)
    if path == "/loop":
        assert len(server.hosts) == 4  # the URL and its 3 redirects, no more


def test_redirects_are_followed_up_to_the_limit(server: Server) -> None:
    assert fetch_image(server.url("/to-cat"), LOOPBACK) == PNG
    none = ImageUrlPolicy(enabled=True, allow_networks=("127.0.0.1/32",), max_redirects=0)
    assert "more than 0 redirects" in _refusal(server.url("/to-cat"), none)


@pytest.mark.parametrize("path", ["/big", "/stream"])
def test_a_body_past_the_byte_limit_is_cut(server: Server, path: str) -> None:
    small = ImageUrlPolicy(enabled=True, allow_networks=("127.0.0.1/32",), max_bytes=1024 * 1024)
    assert "it is over 1 MB" in _refusal(server.url(path), small)
    odd = ImageUrlPolicy(enabled=True, allow_networks=("127.0.0.1/32",), max_bytes=1000)
    assert "it is over 1000 bytes" in _refusal(server.url(path), odd)


@pytest.mark.parametrize("path", ["/stall", "/drip"])
def test_the_whole_fetch_has_one_deadline(server: Server, path: str) -> None:
    quick = ImageUrlPolicy(enabled=True, allow_networks=("127.0.0.1/32",), timeout=0.5)
    started = time.monotonic()
    assert "the fetch took over 0.5 s" in _refusal(server.url(path), quick)
    assert time.monotonic() - started < 3


def test_a_stalled_resolver_or_tls_handshake_ends_at_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    quick = ImageUrlPolicy(enabled=True, allow_networks=("127.0.0.1/32",), timeout=0.5)
    release = threading.Event()

    def stalled(*args: Any, **kwargs: Any) -> list[Any]:
        release.wait()
        raise socket.gaierror(socket.EAI_AGAIN, "released")

    monkeypatch.setattr(image_fetch, "getaddrinfo", stalled)
    try:
        assert "the fetch took over 0.5 s" in _refusal("http://slow.test/cat.png", quick)
    finally:
        release.set()
    monkeypatch.undo()
    with socket.socket() as silent:  # accepts connections (its backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"https://127.0.0.1:{silent.getsockname()[1]}/cat.png"
        assert "the fetch took over 0.5 s" in _refusal(url, quick)


def test_http_errors_and_short_bodies_are_refused(server: Server) -> None:
    assert "answered HTTP 404 Not Found" in _refusal(server.url("/nothing"), LOOPBACK)
    assert "closed before the end" in _refusal(server.url("/short"), LOOPBACK)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    assert "could not connect" in _refusal(f"http://127.0.0.1:{port}/cat.png", LOOPBACK)


def test_fetches_run_side_by_side(server: Server) -> None:
    """A request's URLs wait for the slowest, not for their sum."""
    quick = ImageUrlPolicy(enabled=True, allow_networks=("127.0.0.1/32",), timeout=1.0)
    started = time.monotonic()
    got = fetch_images([server.url("/stall")] * 3 + [server.url("/cat.png")], quick)
    assert time.monotonic() - started < 2.5
    assert got[3] == PNG and all(isinstance(g, FetchRefused) for g in got[:3])


def _messages(*urls: str) -> list[Message]:
    parts: list[Any] = [TextPart(text="Look:"), *(ImagePart(url=url) for url in urls)]
    return [Message(role="user", parts=parts)]


def test_read_images_fetches_and_checks_urls_and_names_the_part(server: Server) -> None:
    (image,) = read_images(_messages(server.url("/cat.png")), None, LOOPBACK)
    assert image.size == (8, 6) and image.mode == "RGB"
    cases = [  # the policy, the second part's URL, the part refused, the words
        (None, server.url("/cat.png"), 1, "not fetched"),
        (ImageUrlPolicy(), server.url("/cat.png"), 1, "not fetched"),
        (ImageUrlPolicy(enabled=True), server.url("/cat.png"), 1, "(loopback)"),
        (LOOPBACK, server.url("/text"), 2, "not a supported image"),
        (LOOPBACK, server.url("/nothing"), 2, "HTTP 404"),
    ]
    for policy, url, part, words in cases:
        with pytest.raises(ApiError) as caught:
            read_images(_messages(server.url("/cat.png"), url), None, policy)
        error = caught.value
        assert error.param == f"messages[0].content[{part}]", error.message
        assert error.status == 400 and error.code == "invalid_image"
        assert words in error.message and error.message.startswith("Invalid image at messages")


# ---- https: the certificate and SNI are the name's, the connection the checked address's --


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for images.test (its own authority, trusted by the fetch
    through SSL_CERT_FILE)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a test certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2"]
        + ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=images.test"]
        + ["-addext", "subjectAltName=DNS:images.test"],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.fixture
def tls_server(certificate: tuple[Path, Path]) -> Iterator[Server]:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*certificate)
    served = Server(context)
    yield served
    served.close()


def test_https_checks_the_names_certificate_and_sends_its_sni(
    tls_server: Server, certificate: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    names = {"images.test": ["127.0.0.1"], "other.test": ["127.0.0.1"]}
    monkeypatch.setattr(image_fetch, "getaddrinfo", _fake_dns(names))
    monkeypatch.setenv("SSL_CERT_FILE", str(certificate[0]))
    url = tls_server.url("/cat.png", host="images.test", scheme="https")
    assert fetch_image(url, LOOPBACK) == PNG
    assert tls_server.sni == ["images.test"]
    assert tls_server.hosts == [f"images.test:{tls_server.port}"]
    other = tls_server.url("/cat.png", host="other.test", scheme="https")
    assert "other.test's TLS certificate did not verify" in _refusal(other, LOOPBACK)
    monkeypatch.delenv("SSL_CERT_FILE")  # the system's authorities know no such certificate
    assert "did not verify" in _refusal(url, LOOPBACK)


def test_the_flags_set_the_nodes_policy() -> None:
    from exo_tp.cli.run import options_from_flags
    from exo_tp.errors import ExoTpError

    assert options_from_flags([]).defaults.image_urls == ImageUrlPolicy()
    flags = ["--image-urls", "--image-url-max-bytes", "1000", "--image-url-timeout", "2.5"]
    flags += ["--image-url-max-redirects", "0", "--image-url-allow-network", "10.1.2.3/16"]
    flags += ["--image-url-allow-network", "fd00::/8"]
    assert options_from_flags(flags).defaults.image_urls == ImageUrlPolicy(
        enabled=True,
        max_bytes=1000,
        timeout=2.5,
        max_redirects=0,
        allow_networks=("10.1.0.0/16", "fd00::/8"),
    )
    with pytest.raises(ExoTpError, match="--image-url-timeout needs --image-urls"):
        options_from_flags(["--image-url-timeout", "3"])
    with pytest.raises(ExoTpError, match="--image-url-max-bytes: .*less than or equal"):
        options_from_flags(["--image-urls", "--image-url-max-bytes", str(BIG * 10)])
    with pytest.raises(SystemExit):  # argparse's usage error
        options_from_flags(["--image-urls", "--image-url-allow-network", "10.1.2.300/8"])
