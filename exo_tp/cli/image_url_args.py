"""`exo-tp run --image-urls` and its limits: whether the API fetches the http(s) image URLs of
requests (off: they are a 400), as GenerationDefaults.image_urls (docs/api.md, "Image URLs")."""

from __future__ import annotations

import argparse
import ipaddress
from typing import TYPE_CHECKING

from exo_tp.cli.args import non_negative_int, positive_float, positive_int

if TYPE_CHECKING:
    from exo_tp.api.core.image_fetch import ImageUrlPolicy

# ImageUrlPolicy's limits and the flags that set them (left None: the policy's default)
_FLAGS = {
    "max_bytes": "--image-url-max-bytes",
    "timeout": "--image-url-timeout",
    "max_redirects": "--image-url-max-redirects",
    "allow_networks": "--image-url-allow-network",
}


def _network(text: str) -> str:
    try:
        return str(ipaddress.ip_network(text.strip(), strict=False))
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not a network ({error})") from None


def add_image_url_args(p: argparse.ArgumentParser) -> None:
    from exo_tp.api.core.image_fetch import ImageUrlPolicy

    default = ImageUrlPolicy()
    group = p.add_argument_group("image URLs (fetched only with --image-urls)")
    group.add_argument(
        "--image-urls",
        action="store_true",
        help="fetch the http(s) image URLs of requests (default: off, such a URL is a 400); "
        "only public addresses are reached, never this machine's or its networks'",
    )
    group.add_argument(
        _FLAGS["max_bytes"],
        type=positive_int,
        metavar="BYTES",
        help=f"largest image fetched, in bytes (default and most: {default.max_bytes})",
    )
    group.add_argument(
        _FLAGS["timeout"],
        type=positive_float,
        metavar="SECONDS",
        help=f"seconds for one URL's whole fetch, redirects included (default {default.timeout:g})",
    )
    group.add_argument(
        _FLAGS["max_redirects"],
        type=non_negative_int,
        metavar="N",
        help=f"redirects followed, each checked like the URL (default {default.max_redirects})",
    )
    group.add_argument(
        _FLAGS["allow_networks"],
        type=_network,
        action="append",
        metavar="CIDR",
        help="a network fetched from although it is not public, e.g. 192.168.1.0/24 "
        "(repeatable): only for a trusted LAN, every host in it becomes reachable to clients",
    )


def image_url_policy(args: argparse.Namespace) -> ImageUrlPolicy:
    """The flags' policy; a limit without --image-urls, or a bad value, is one readable error."""
    from pydantic import ValidationError

    from exo_tp.api.core.image_fetch import ImageUrlPolicy
    from exo_tp.errors import ExoTpError

    given = {
        field: value
        for field, flag in _FLAGS.items()
        if (value := getattr(args, flag.removeprefix("--").replace("-", "_"))) is not None
    }
    if given and not args.image_urls:
        raise ExoTpError(f"{_FLAGS[next(iter(given))]} needs --image-urls (URLs are not fetched)")
    try:
        return ImageUrlPolicy.model_validate({"enabled": args.image_urls, **given})
    except ValidationError as error:
        first = error.errors()[0]
        field = str(first["loc"][0])
        raise ExoTpError(f"{_FLAGS.get(field, field)}: {first['msg']}") from None
