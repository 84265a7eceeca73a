"""Hardened image intake: decode untrusted bytes into a PIL image under explicit limits.

Every failure is an `ImageError` whose message names the problem and nothing of the server
(no paths, memory addresses or tracebacks), so the API can return it to the client as is.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageFile, ImageOps


class ImageError(ValueError):
    """An image is missing, malformed, too large, too small or of a format that is not allowed.
    `index`: which of a request's images, where one request has several (None: not said)."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


@dataclass(slots=True)
class ImageLimits:
    max_pixels: int = 4096 * 4096
    min_side: int = 2
    max_bytes: int = 20 * 1024 * 1024
    allowed_formats: frozenset[str] = frozenset({"JPEG", "PNG", "WEBP", "GIF", "BMP"})
    # Turn the pixels as an EXIF Orientation tag says, the way viewers (and transformers'
    # load_image) show a phone photo stored sideways.
    apply_exif_orientation: bool = True


_DEFAULT_LIMITS = ImageLimits()


def load_image(
    obj: Image.Image | bytes | bytearray | memoryview | Path,
    limits: ImageLimits | None = None,
    *,
    name: str = "image",
) -> Image.Image:
    """Check and fully decode an image; `name` ("image 2") labels it in error messages.

    Encoded bytes are identified with the allowed formats' decoders only, and their header's
    size is checked before any pixel is decoded. The mode is left as decoded.
    """
    limits = limits or _DEFAULT_LIMITS
    if isinstance(obj, Image.Image):
        _check_size(obj, limits, name)
        _decode(obj, name)
        return _as_seen(obj, limits, name)
    if isinstance(obj, Path):
        obj = _read_file(obj, limits, name)
    if not isinstance(obj, (bytes, bytearray, memoryview)):
        raise ImageError(f"expected a PIL image, encoded image bytes or a path, got {type(obj).__name__}")

    nbytes = obj.nbytes if isinstance(obj, memoryview) else len(obj)
    if nbytes > limits.max_bytes:
        raise ImageError(f"{name} is {nbytes} bytes, over the limit of {limits.max_bytes}")
    try:
        image = _open_lazily(bytes(obj), limits.allowed_formats)
    except Exception as e:
        raise ImageError(f"{name} is not a decodable image") from e
    if image is None:
        allowed = ", ".join(sorted(limits.allowed_formats))
        raise ImageError(f"{name} is not a decodable image in an allowed format ({allowed})")
    _check_size(image, limits, name)
    _decode(image, name)
    return _as_seen(image, limits, name)


_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")


def _as_seen(image: Image.Image, limits: ImageLimits, name: str) -> Image.Image:
    """The image as a viewer shows it: EXIF orientation applied (when the limits say so), 16-bit
    and 32-bit grey scaled to 8 bits (converting it to RGB would clip everything above 255 to
    white), float grey scaled from [0, 1]. Palette, alpha, 1-bit and CMYK images stay as they are:
    the families' RGB conversion composites alpha on white, as transformers does."""
    try:
        if limits.apply_exif_orientation and image.getexif().get(0x0112, 1) != 1:
            image = ImageOps.exif_transpose(image)
        if image.mode in _SIXTEEN_BIT or image.mode == "I":
            grey = np.asarray(image).astype(np.int64).clip(0, 65535) >> 8
            image = Image.fromarray(grey.astype(np.uint8))  # 2-D uint8: mode L
        elif image.mode == "F":  # float grey: [0, 1] as most tools write it, else 0-255
            grey = np.nan_to_num(np.asarray(image, dtype=np.float64))
            scale = 255.0 if grey.size and grey.max() <= 1.0 else 1.0
            image = Image.fromarray((grey * scale).round().clip(0, 255).astype(np.uint8))
    except Exception as e:  # a malformed EXIF block, an odd mode: never the client's traceback
        raise ImageError(f"{name} could not be converted (orientation or bit depth)") from e
    return image


def _read_file(path: Path, limits: ImageLimits, name: str) -> bytes:
    try:
        nbytes = path.stat().st_size
        if nbytes <= limits.max_bytes:
            return path.read_bytes()
    except OSError as e:
        raise ImageError(f"{name} could not be read") from e
    raise ImageError(f"{name} is {nbytes} bytes, over the limit of {limits.max_bytes}")


def _open_lazily(data: bytes, formats: frozenset[str]) -> ImageFile.ImageFile | None:
    """Identify `data` with the allowed formats' plugins only, reading the header but no pixels.

    This is `Image.open(fp, formats=...)` without Pillow's own decompression-bomb check, which
    warns (through the process-wide warnings machinery) or raises before we can apply our
    stricter limit with a message that names the size.
    """
    prefix = data[:16]
    for fmt in sorted(formats):
        if fmt not in Image.OPEN:
            Image.init()
        if fmt not in Image.OPEN:
            continue
        factory, accept = Image.OPEN[fmt]
        accepted = accept(prefix) if accept else True
        if not accepted or isinstance(accepted, str):  # a str is Pillow's "recognised, unsupported"
            continue
        try:
            return factory(io.BytesIO(data), "")
        except (SyntaxError, IndexError, TypeError, struct.error):  # Image.open's "not this format"
            continue
    return None


def _check_size(image: Image.Image, limits: ImageLimits, name: str) -> None:
    w, h = image.size
    if w * h > limits.max_pixels:
        raise ImageError(f"{name} is {w}x{h} = {w * h} pixels, over the limit of {limits.max_pixels}")
    if min(w, h) < limits.min_side:
        raise ImageError(f"{name} is {w}x{h}, below the minimum side of {limits.min_side} pixels")


def _decode(image: Image.Image, name: str) -> None:
    # Decoders of untrusted data fail in many ways (OSError for truncation, SyntaxError,
    # ValueError, struct.error, DecompressionBombError for a GIF frame that grows the canvas,
    # ...); none of their messages may reach the client.
    try:
        image.load()
    except Exception as e:
        fmt = f" {image.format}" if image.format else ""
        raise ImageError(f"{name} is not a decodable image (truncated or corrupt{fmt} data)") from e


def decode_data_url(url: str, media: str = "image") -> bytes:
    """Return the payload of a `data:<media>/<fmt>;base64,<payload>` URL (media: image or video)."""
    if not isinstance(url, str) or url[:5].lower() != "data:":
        raise ImageError(f"expected a data URL (data:{media}/<format>;base64,...)")
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise ImageError("data URL has no ',' before its payload")
    media_type, *params = (p.strip().lower() for p in header.split(";"))
    if not media_type.startswith(f"{media}/"):
        raise ImageError(f"data URL media type must be {media}/*, got {media_type[:50] or 'none'!r}")
    if "base64" not in params:
        raise ImageError("data URL must be base64-encoded")
    payload = "".join(payload.split())  # line-wrapped base64 is common
    payload += "=" * (-len(payload) % 4)  # so is missing padding
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError("data URL payload is not valid base64") from e


def image_content_hash(image: Image.Image, salt: bytes = b"") -> str:
    """sha256 hex of what decides the model's input: mode, size, pixels, palette, transparency."""
    # A palette image's colours and any transparency key change the RGB the model sees.
    palette = b""
    if image.palette is not None:
        palette = image.palette.mode.encode() + bytes(image.getpalette(image.palette.mode) or ())
    parts = (
        image.mode.encode(),
        f"{image.width}x{image.height}".encode(),
        salt,
        palette,
        repr(image.info.get("transparency")).encode(),
    )
    h = hashlib.sha256()
    for part in parts:  # length-prefixed so that no two different tuples hash alike
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    h.update(image.tobytes())
    return h.hexdigest()
