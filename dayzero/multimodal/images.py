"""A request's image -> an RGB PIL image and its content hash (Pillow).

Accepted: a PIL image; the file's bytes; a `data:image/...;base64,...` URL; a `file://` URL or a local
path; a bare base64 string (SGLang's image_data). Nothing is fetched over the network: an http(s) URL is
refused, naming what to send instead. An image is refused (ImageError, a ValueError naming the image
and the problem) when it cannot be decoded or has more pixels than DAYZERO_MAX_IMAGE_PIXELS; the
limit is checked from the header, before the pixels are decoded.

Transparency is composited onto white and every image converted to RGB, as transformers' image
processors do (`convert_to_rgb`). The hash (`image_hash`) is of the RGB pixels and the size: the same
picture sent as a file, a data URL or a PIL image hashes alike.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
from pathlib import Path
from urllib.parse import unquote, urlparse

from PIL import Image, UnidentifiedImageError

from dayzero import settings

NETWORK_SCHEMES = ("http", "https", "ftp", "s3", "gs")


class ImageError(ValueError):
    """An image of a request cannot be used; the message says which and why."""


def load_image(source, where: str = "image") -> Image.Image:
    """The RGB image `source` holds (see the module docstring), or ImageError naming `where`."""
    if isinstance(source, Image.Image):
        image = source
        _check_size(image.width, image.height, where)
    else:
        image = _open(_read_bytes(source, where), where)
    try:
        return _to_rgb(image)
    except (OSError, ValueError) as exc:
        raise ImageError(f"{where}: the image cannot be decoded ({exc})") from None


def image_hash(image: Image.Image) -> str:
    """Content hash of an RGB image: blake2b-128 of its size and pixels, hex."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{image.width}x{image.height}".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def _read_bytes(source, where: str) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if isinstance(source, Path):
        return _read_file(source, where)
    if not isinstance(source, str):
        raise ImageError(f"{where}: expected a PIL image, bytes, a data: URL or a file:// path, got "
                         f"{type(source).__name__}")
    text = source.strip()
    scheme = text.split(":", 1)[0].lower() if ":" in text[:8] else ""
    if scheme == "data":
        header, sep, payload = text.partition(",")
        if not sep or ";base64" not in header:
            raise ImageError(f"{where}: a data URL must be data:image/<type>;base64,<payload>")
        return _b64(payload, where)
    if scheme == "file":
        parsed = urlparse(text)
        if parsed.netloc not in ("", "localhost"):
            raise ImageError(f"{where}: file:// URLs must name a local path (file:///path/to/image.png), got host "
                             f"{parsed.netloc!r}")
        return _read_file(Path(unquote(parsed.path)), where)
    if scheme in NETWORK_SCHEMES:
        raise ImageError(f"{where}: images are not fetched over the network ({scheme}:// URL); send the image "
                         "inline as a data:image/...;base64 URL, or a file:// path on the server's machine")
    if os.path.isabs(text) and os.path.isfile(text):
        return _read_file(Path(text), where)
    return _b64(text, where)


def _read_file(path: Path, where: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ImageError(f"{where}: cannot read {path}: {exc.strerror or exc}") from None


def _b64(payload: str, where: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{where}: not valid base64 image data (send a data:image/...;base64 URL or a file:// "
                         "path)") from None


def _open(data: bytes, where: str) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:
        raise ImageError(f"{where}: the image is over the size limit ({exc})") from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ImageError(f"{where}: the image cannot be decoded ({type(exc).__name__}: {exc}); send a PNG, JPEG, "
                         "WebP, GIF or BMP file") from None
    _check_size(image.width, image.height, where)
    try:
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageError(f"{where}: the image cannot be decoded ({exc})") from None
    return image


def _check_size(width: int, height: int, where: str) -> None:
    limit = settings.get().max_image_pixels
    if width < 1 or height < 1:
        raise ImageError(f"{where}: the image is empty ({width} x {height} pixels)")
    if width * height > limit:
        raise ImageError(f"{where}: the image is over the size limit: {width} x {height} = {width * height} pixels, "
                         f"the limit is {limit} (DAYZERO_MAX_IMAGE_PIXELS)")


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")
