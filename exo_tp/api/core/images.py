"""A request's images, read and checked before any rank sees them: each bad one is a 400 naming
its part (docs/api.md lists the limits). The dialects only decode base64 (`image_bytes`);
`read_images` opens each with Pillow off the event loop."""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from exo_tp.api.core.conversation import ImagePart, Message
from exo_tp.api.core.errors import ApiError

if TYPE_CHECKING:  # image_fetch imports this module's limits
    from exo_tp.api.core.image_fetch import ImageUrlPolicy

MAX_IMAGE_BYTES = 20 * 1024 * 1024  # a file, as sent (OpenAI's own limit per image)
MAX_IMAGE_PIXELS = 50_000_000  # width x height, read from the header before decoding
MAX_IMAGES = 16  # per request, over all its messages
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # what Pillow decodes without plugins

_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*),", re.ASCII)


def image_bytes(encoded: str, what: str) -> bytes:
    """The bytes of base64 ``encoded`` (standard or URL-safe, padding optional); ValueError
    (the dialect's 400) naming ``what`` otherwise."""
    text = encoded.strip()
    if len(text) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ValueError(f"{what} is over {MAX_IMAGE_BYTES // (1024 * 1024)} MB")
    try:
        padded = text + "=" * (-len(text) % 4)
        return base64.b64decode(padded.replace("-", "+").replace("_", "/"), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{what} is not valid base64") from None


def image_from_url(url: str, detail: str | None = None) -> ImagePart:
    """An ``image_url``'s part: a data URL's bytes, or the http(s) URL kept for the fetch
    policy; anything else is a ValueError."""
    if url.startswith("data:"):
        match = _DATA_URL.match(url)
        if match is None or ";base64" not in (match.group("params") or ""):
            raise ValueError("a data URL must be base64: data:image/png;base64,...")
        return ImagePart(data=image_bytes(url[match.end() :], "the data URL"), detail=detail)
    if url.startswith(("http://", "https://")):
        return ImagePart(url=url, detail=detail)
    raise ValueError("an image URL must be a data URL (data:image/...;base64,...) or http(s)")


def _param(index: int, part: int) -> str:
    return f"messages[{index}].content[{part}]"


def _refuse(param: str, message: str) -> ApiError:
    return ApiError(400, f"Invalid image at {param}: {message}", param=param, code="invalid_image")


def _open(data: bytes, param: str) -> Any:
    from PIL import Image

    if len(data) > MAX_IMAGE_BYTES:
        raise _refuse(param, f"it is over {MAX_IMAGE_BYTES // (1024 * 1024)} MB")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise _refuse(
                    param,
                    f"{width}x{height} is over {MAX_IMAGE_PIXELS // 1_000_000} million pixels",
                )
            image.load()  # a truncated or corrupt file fails here, not on a rank
    except ApiError:
        raise
    except Image.UnidentifiedImageError:  # (its message names a buffer's address: left out)
        raise _refuse(param, f"not a supported image ({', '.join(FORMATS)})") from None
    except Image.DecompressionBombError:
        raise _refuse(param, "too many pixels for its size (a decompression bomb)") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombWarning) as error:
        raise _refuse(param, f"the image could not be decoded ({error})") from None
    return image.convert("RGB")


def read_images(
    messages: Sequence[Message], refusal: str | None, urls: ImageUrlPolicy | None = None
) -> list[Any]:
    """The conversation's images, in order, as RGB PIL images (mlx-vlm's processors take
    them); an http(s) URL's fetched under ``urls`` (None: not fetched, a 400); the first bad
    one raises its 400."""
    found = [
        (i, j, part)
        for i, message in enumerate(messages)
        for j, part in enumerate(message.parts)
        if isinstance(part, ImagePart)
    ]
    if not found:
        return []
    first = _param(found[0][0], found[0][1])
    if refusal is not None:  # why this model takes none
        raise ApiError(
            400,
            f"This model takes no images ({refusal}); {first} is an image.",
            param=first,
            code="images_not_supported",
        )
    if len(found) > MAX_IMAGES:
        raise ApiError(
            400,
            f"Too many images: {len(found)}; at most {MAX_IMAGES} per request.",
            param="messages",
            code="too_many_images",
        )
    fetched = _fetch_urls(found, urls)
    images = []
    for k, (i, j, part) in enumerate(found):
        data = part.data if part.data is not None else fetched[k]
        if isinstance(data, ApiError):
            raise data
        images.append(_open(data, _param(i, j)))
    return images


def _fetch_urls(
    found: list[tuple[int, int, ImagePart]], urls: ImageUrlPolicy | None
) -> dict[int, bytes | ApiError]:
    """Each URL part's bytes (by its index in ``found``), fetched as the server's policy
    allows (off by default), or its 400; raised in the parts' order by the caller."""
    wanted = {
        k: (part.url or "", _param(i, j))
        for k, (i, j, part) in enumerate(found)
        if part.data is None
    }
    if not wanted:
        return {}
    if urls is None or not urls.enabled:
        why = "image URLs are not fetched by this server; send the image as a data URL"
        return {k: _refuse(param, why) for k, (_, param) in wanted.items()}
    from exo_tp.api.core.image_fetch import fetch_images

    got = fetch_images([url for url, _ in wanted.values()], urls)
    return {
        k: data if isinstance(data, bytes) else _refuse(param, f"fetching its URL: {data}")
        for (k, (_, param)), data in zip(wanted.items(), got, strict=True)
    }
