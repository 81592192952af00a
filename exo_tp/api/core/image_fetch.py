"""Image URLs fetched for a request (issue #58), off unless the operator turns them on
(`exo-tp run --image-urls`). A URL is the client's, so the fetch must not become a way into the
server's own networks (SSRF): only http(s), and only to public addresses. The host is resolved
once, every address it gives is checked, and the connection goes to a checked address with the
original name in the Host header and in TLS (SNI and the certificate's check): a second lookup,
which a DNS-rebinding name would answer with a private address, never happens. Each redirect
hop is checked the same way; the whole fetch has one deadline; the body is cut at a byte limit.

Synchronous: chat_prompt runs on a worker thread, off the event loop. The standard library's
http.client, because it lets the connection be pinned to an address (and reads no proxy
settings from the environment, which would route around the address check)."""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

from pydantic import Field, field_validator

from exo_tp.api.core.images import MAX_IMAGE_BYTES
from exo_tp.frozen import Frozen

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_MB = 1024 * 1024
_CHUNK = 64 * 1024
_BACKSTOP = 1.0  # seconds
_REDIRECTS = (301, 302, 303, 307, 308)
_HEADERS = {"Accept": "image/*", "User-Agent": "exo-tp (image URL)"}  # some hosts refuse none
_CGNAT = ipaddress.IPv4Network("100.64.0.0/10")  # RFC 6598 shared space: not global, not private
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052: the last 32 bits are an IPv4 address
# The resolver, a name of this module so that unit tests can answer for made-up hosts.
getaddrinfo = socket.getaddrinfo


class ImageUrlPolicy(Frozen):
    """What `exo-tp run --image-urls` and its limits allow (GenerationDefaults.image_urls)."""

    enabled: bool = False  # off: an image URL is a 400, nothing is fetched
    # More than images.MAX_IMAGE_BYTES could never be read as an image anyway.
    max_bytes: int = Field(default=MAX_IMAGE_BYTES, ge=1, le=MAX_IMAGE_BYTES)
    timeout: float = Field(default=10.0, gt=0.0)  # seconds for the whole fetch, redirects included
    max_redirects: int = Field(default=3, ge=0)
    # CIDRs fetched from although not public (--image-url-allow-network): for trusted LANs only.
    allow_networks: tuple[str, ...] = ()

    @field_validator("allow_networks")
    @classmethod
    def _networks(cls, networks: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(str(ipaddress.ip_network(n.strip(), strict=False)) for n in networks)

    def allows(self, address: IPAddress) -> bool:
        """Whether ``address`` is in a network the operator allowed (an IPv4 address inside
        an IPv6 form counts as itself)."""
        inner = _embedded_v4(address)
        candidates = [address] if inner is None else [address, inner]
        return any(
            a.version == n.version and a in n
            for n in map(ipaddress.ip_network, self.allow_networks)
            for a in candidates
        )


class FetchRefused(ValueError):
    """Why an image URL was not fetched: the client's 400 (images._refuse names its part)."""


def _embedded_v4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one stands for, where a connection to it reaches that address
    (IPv4-mapped, 6to4, NAT64's well-known prefix)."""
    if isinstance(address, ipaddress.IPv4Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def address_refusal(address: IPAddress, policy: ImageUrlPolicy) -> str | None:
    """What kind of non-public address ``address`` is (the 400's words), or None when a fetch
    may connect to it: a global unicast address, or one in an allowed network."""
    if policy.allows(address):
        return None
    inner = _embedded_v4(address)
    if inner is not None and (kind := address_refusal(inner, policy)) is not None:
        return f"{kind} (as IPv6)"
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return None  # the IPv4 address itself, public (::ffff:0:0/96 is otherwise reserved)
    checks = (
        ("unspecified", address.is_unspecified),
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("shared (CGNAT)", address in _CGNAT),
        ("private", address.is_private),
        ("reserved", address.is_reserved),
        ("site-local", isinstance(address, ipaddress.IPv6Address) and address.is_site_local),
    )
    for kind, hit in checks:
        if hit:
            return kind
    return None if address.is_global else "not global"


@dataclass(frozen=True)
class _Target:
    """One hop's URL, split: the scheme, the host as sent (IDNA), its port, the path."""

    url: str
    tls: bool
    host: str
    port: int
    path: str

    @classmethod
    def of(cls, url: str) -> _Target:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise FetchRefused(f"only http and https URLs are fetched, not {parts.scheme or url!r}")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
            host = (parts.hostname or "").encode("idna").decode("ascii")
        except (ValueError, UnicodeError) as error:
            raise FetchRefused(f"the URL's host or port is not valid ({error})") from None
        if not host:
            raise FetchRefused("the URL has no host")
        path = parts.path or "/"
        return cls(url, parts.scheme == "https", host, port, f"{path}?{parts.query}".rstrip("?"))


class _Deadline:
    """The whole fetch's one deadline: what is left of it for the next step."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        left = self.at - time.monotonic()
        if left <= 0:
            raise self.passed()
        return left

    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def passed(self) -> FetchRefused:
        return FetchRefused(f"the fetch took over {self.seconds:g} s (this server's limit)")


def _resolve(target: _Target, deadline: _Deadline) -> list[tuple[int, Any]]:
    """(family, socket address) of each address ``target.host`` resolves to, once. On a
    thread: getaddrinfo takes no timeout, and a stalled resolver must not outlast the fetch."""
    found: list[Any] = []
    failed: list[OSError] = []
    done = threading.Event()

    def look_up() -> None:
        try:
            found.extend(getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM))
        except OSError as error:
            failed.append(error)
        finally:
            done.set()

    threading.Thread(target=look_up, name="image-url-dns", daemon=True).start()
    if not done.wait(deadline.left()):
        raise deadline.passed()
    if failed or not found:
        raise FetchRefused(f"the host {target.host} could not be resolved")
    return [(family, sockaddr) for family, _, _, _, sockaddr in found]


def _checked(target: _Target, policy: ImageUrlPolicy, deadline: _Deadline) -> list[tuple[int, Any]]:
    """The addresses to connect to: all of them public (or allowed), else a refusal."""
    addresses = _resolve(target, deadline)
    for _, sockaddr in addresses:
        address = ipaddress.ip_address(str(sockaddr[0]).split("%")[0])
        kind = address_refusal(address, policy)
        if kind is not None:
            verb = "is" if target.host == str(address) else "resolves to"
            raise FetchRefused(
                f"{target.host} {verb} a non-public address ({kind}); "
                "image URLs may only reach public addresses"
            )
    return addresses


class _Watchdog:
    """Cuts the fetch's socket when its deadline passes: a server that drips bytes (in its TLS
    handshake, its headers or its body) keeps each read within the socket's timeout; shutting
    the socket down ends whatever read is waiting."""

    def __init__(self, deadline: _Deadline):
        self.fired = threading.Event()
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._timer = threading.Timer(max(0.0, deadline.at - time.monotonic()), self._cut)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, sock: socket.socket) -> None:
        """``sock`` is the one to cut (a TLS socket replaces the plain one it took over)."""
        with self._lock:
            self._sock = sock
            if self.fired.is_set():
                self._shut()

    def _cut(self) -> None:
        with self._lock:
            self.fired.set()
            self._shut()

    def _shut(self) -> None:
        if self._sock is not None:
            # The plain socket's shutdown: an SSLSocket's own drops its TLS state under the
            # read that is using it. OSError: not connected yet, or closed already.
            with contextlib.suppress(OSError):
                socket.socket.shutdown(self._sock, socket.SHUT_RDWR)

    def cancel(self) -> None:
        self._timer.cancel()


class _PinnedConnection(http.client.HTTPConnection):
    """An HTTP(S) connection to ``host`` (its Host header, SNI and certificate name) made to
    an address checked beforehand, never to a fresh lookup of the name."""

    def __init__(
        self, target: _Target, address: tuple[int, Any], deadline: _Deadline, watchdog: _Watchdog
    ):
        # The watchdog keeps the deadline; each socket step's own timeout is a backstop past it
        super().__init__(target.host, target.port, timeout=deadline.left() + _BACKSTOP)
        self.address, self.tls, self.watchdog = address, target.tls, watchdog
        if target.tls:
            self.default_port = 443  # Host carries no ":443", as for HTTPSConnection

    def connect(self) -> None:
        family, sockaddr = self.address
        sock = socket.socket(family, socket.SOCK_STREAM)
        self.watchdog.watch(sock)
        try:
            sock.settimeout(self.timeout)
            sock.connect(sockaddr)
            if self.tls:  # a fresh default context: system CAs (SSL_CERT_FILE), hostname check
                context = ssl.create_default_context()
                sock = context.wrap_socket(
                    sock, server_hostname=self.host, do_handshake_on_connect=False
                )
                self.watchdog.watch(sock)
                sock.do_handshake()
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def _connect(
    target: _Target, policy: ImageUrlPolicy, deadline: _Deadline, watchdog: _Watchdog
) -> _PinnedConnection:
    """A connection to the first checked address that answers."""
    failure: OSError | None = None
    for address in _checked(target, policy, deadline):
        connection = _PinnedConnection(target, address, deadline, watchdog)
        try:
            connection.connect()
            return connection
        except ssl.SSLCertVerificationError as error:
            connection.close()
            raise FetchRefused(
                f"{target.host}'s TLS certificate did not verify ({error.verify_message})"
            ) from None
        except OSError as error:
            connection.close()
            failure = error
    deadline.left()  # a connect that timed out is the deadline's refusal
    reason = getattr(failure, "strerror", None) or failure
    raise FetchRefused(f"could not connect to {target.host}:{target.port} ({reason})")


def _body(response: http.client.HTTPResponse, policy: ImageUrlPolicy) -> bytes:
    """The response's body, read a chunk at a time and refused past ``policy.max_bytes``."""
    limit = policy.max_bytes
    too_big = FetchRefused(f"it is over {_size(limit)} (this server's limit for image URLs)")
    length = response.getheader("Content-Length")
    if length is not None and length.strip().isdigit() and int(length) > limit:
        raise too_big
    body = bytearray()
    while chunk := response.read1(_CHUNK):  # one read at a time: the watchdog can cut it
        body += chunk
        if len(body) > limit:
            raise too_big
    if response.length:  # Content-Length promised more than came
        raise FetchRefused("the connection closed before the end of the image")
    return bytes(body)


def _size(count: int) -> str:
    return f"{count // _MB} MB" if count % _MB == 0 else f"{count} bytes"


def _get(
    target: _Target, policy: ImageUrlPolicy, deadline: _Deadline, watchdog: _Watchdog
) -> bytes | str:
    """One hop: the body of a 2xx answer, or a redirect's Location (a str)."""
    connection: _PinnedConnection | None = None
    try:
        connection = _connect(target, policy, deadline, watchdog)
        got = _exchange(connection, target, policy)
    except (OSError, http.client.HTTPException, FetchRefused) as error:
        if watchdog.fired.is_set() or deadline.expired():  # however the step saw its end
            raise deadline.passed() from None
        if isinstance(error, FetchRefused):
            raise
        raise FetchRefused(f"the fetch from {target.host} failed ({error})") from None
    finally:
        if connection is not None:
            connection.close()
    if watchdog.fired.is_set():  # a body read to its end-of-file may be the cut's
        raise deadline.passed()
    return got


def _exchange(
    connection: _PinnedConnection, target: _Target, policy: ImageUrlPolicy
) -> bytes | str:
    connection.request("GET", target.path, headers=_HEADERS)
    response = connection.getresponse()
    if response.status in _REDIRECTS:
        location = response.getheader("Location")
        if not location:
            raise FetchRefused(f"HTTP {response.status} from {target.host} has no Location")
        return location
    if not 200 <= response.status < 300:
        reason = response.reason[:100]
        raise FetchRefused(f"{target.host} answered HTTP {response.status} {reason}".strip())
    return _body(response, policy)


def fetch_image(url: str, policy: ImageUrlPolicy) -> bytes:
    """The bytes at ``url`` (an http or https URL) under ``policy``, redirects followed; a
    FetchRefused saying why not otherwise."""
    if not policy.enabled:
        raise FetchRefused("image URLs are not fetched by this server")
    deadline = _Deadline(policy.timeout)
    watchdog = _Watchdog(deadline)
    try:
        for _ in range(policy.max_redirects + 1):
            got = _get(_Target.of(url), policy, deadline, watchdog)
            if isinstance(got, bytes):
                return got
            url = urljoin(url, got)
    finally:
        watchdog.cancel()
    raise FetchRefused(f"more than {policy.max_redirects} redirects")


def fetch_images(urls: Sequence[str], policy: ImageUrlPolicy) -> list[bytes | FetchRefused]:
    """Each URL's bytes, or why not, fetched side by side: a request waits for its slowest
    URL rather than their sum (prompts are built on one thread, which other requests wait on)."""

    def one(url: str) -> bytes | FetchRefused:
        try:
            return fetch_image(url, policy)
        except FetchRefused as refused:
            return refused

    if len(urls) <= 1:
        return [one(url) for url in urls]
    with ThreadPoolExecutor(len(urls), thread_name_prefix="image-url") as pool:
        return list(pool.map(one, urls))
