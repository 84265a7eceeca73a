"""Image intake: limits checked before pixels are decoded, and errors that say what is wrong."""

from __future__ import annotations

import base64
import io
import struct
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image

from mm_engine.vision.image_io import (
    ImageError,
    ImageLimits,
    decode_data_url,
    image_content_hash,
    load_image,
)


def _noise_image(width: int = 40, height: int = 30, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims width x height, with no pixel data behind it."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"") + chunk(b"IEND", b"")


def _assert_clean(message: str) -> None:
    for leak in ("0x", "Traceback", "/tmp", "BytesIO", "<"):
        assert leak not in message


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_allowed_formats_load_fully_decoded(fmt):
    image = load_image(_encode(_noise_image(), fmt))
    assert image.size == (40, 30)
    assert image.im is not None  # pixels are decoded, not lazy


def test_mode_is_kept_and_bytes_like_inputs_work():
    data = _encode(_noise_image().convert("L"), "PNG")
    for obj in (data, bytearray(data), memoryview(data)):
        assert load_image(obj).mode == "L"
    rgba = _noise_image().convert("RGBA")
    assert load_image(rgba) is rgba


def test_path_input(tmp_path):
    path = tmp_path / "cat.png"
    path.write_bytes(_encode(_noise_image(), "PNG"))
    assert load_image(path).size == (40, 30)
    with pytest.raises(ImageError, match="could not be read") as err:
        load_image(tmp_path / "missing.png")
    _assert_clean(str(err.value))


def test_truncated_jpeg():
    data = _encode(_noise_image(200, 200), "JPEG")
    with pytest.raises(ImageError, match="is not a decodable image") as err:
        load_image(data[: len(data) // 2])
    _assert_clean(str(err.value))


def test_random_bytes_name_the_image():
    junk = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    with pytest.raises(ImageError, match="^image 2 is not a decodable image") as err:
        load_image(junk, name="image 2")
    _assert_clean(str(err.value))


@pytest.mark.parametrize("side", [30000, 12000])
def test_pixel_bomb_refused_from_header(side):
    # 30000^2 is past Pillow's own error threshold, 12000^2 past its warning threshold; neither may
    # leak as a Pillow error or warning, and no pixels are allocated.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ImageError) as err:
            load_image(_png_header_only(side, side))
    assert str(err.value) == f"image is {side}x{side} = {side * side} pixels, over the limit of 16777216"


def test_pixel_limit_applies_to_pil_images():
    with pytest.raises(ImageError, match="40x30 = 1200 pixels, over the limit of 1000"):
        load_image(_noise_image(), ImageLimits(max_pixels=1000))


def test_min_side():
    with pytest.raises(ImageError, match="1x1, below the minimum side of 2"):
        load_image(_encode(Image.new("RGB", (1, 1)), "PNG"))
    assert load_image(_encode(Image.new("RGB", (1, 1)), "PNG"), ImageLimits(min_side=1)).size == (1, 1)


def test_max_bytes():
    data = _encode(_noise_image(), "PNG")
    with pytest.raises(ImageError, match=f"{len(data)} bytes, over the limit of 100"):
        load_image(data, ImageLimits(max_bytes=100))


def test_disallowed_format():
    data = _encode(_noise_image(), "TIFF")
    with pytest.raises(ImageError, match=r"allowed format \(BMP, GIF, JPEG, PNG, WEBP\)"):
        load_image(data)
    assert load_image(data, ImageLimits(allowed_formats=frozenset({"TIFF"}))).size == (40, 30)
    with pytest.raises(ImageError, match="allowed format"):
        load_image(_encode(_noise_image(), "PNG"), ImageLimits(allowed_formats=frozenset({"JPEG"})))


@pytest.mark.parametrize(("obj", "kind"), [(5, "int"), ("cat.png", "str"), (None, "NoneType")])
def test_wrong_type(obj, kind):
    with pytest.raises(ImageError, match=f"expected a PIL image, encoded image bytes or a path, got {kind}$"):
        load_image(obj)


def test_data_url_round_trip():
    data = _encode(_noise_image(), "PNG")
    payload = base64.b64encode(data).decode()
    assert decode_data_url(f"data:image/png;base64,{payload}") == data
    wrapped = "\n".join(payload[i : i + 76] for i in range(0, len(payload), 76)).rstrip("=")
    assert decode_data_url(f"DATA:Image/PNG;base64,{wrapped}") == data
    assert load_image(decode_data_url(f"data:image/jpeg;base64,{payload}")).format == "PNG"


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("https://example.com/cat.png", "expected a data URL"),
        ("data:text/plain;base64,aGVsbG8=", "media type must be image"),
        ("data:image/png,%89PNG", "base64"),
        ("data:image/png;base64", "no ','"),
        ("data:image/png;base64,not*base64!", "not valid base64"),
    ],
)
def test_bad_data_urls(url, match):
    with pytest.raises(ImageError, match=match):
        decode_data_url(url)


def test_content_hash():
    image = _noise_image()
    png = _encode(image, "PNG")
    other_encoding = _encode(image, "PNG", compress_level=1)
    assert png != other_encoding
    a, b = load_image(png), load_image(other_encoding)
    assert image_content_hash(a) == image_content_hash(b) == image_content_hash(image)
    assert len(image_content_hash(a)) == 64

    changed = image.copy()
    changed.putpixel((7, 3), (1, 2, 3) if changed.getpixel((7, 3)) != (1, 2, 3) else (4, 5, 6))
    assert image_content_hash(changed) != image_content_hash(image)
    assert image_content_hash(image, salt=b"clip-336") != image_content_hash(image)
    assert image_content_hash(image.convert("RGBA")) != image_content_hash(image)


def test_content_hash_sees_palette_and_transparency():
    palette = _noise_image().quantize(16)
    recoloured = palette.copy()
    recoloured.putpalette([255 - v for v in palette.getpalette()])
    assert palette.tobytes() == recoloured.tobytes()
    assert image_content_hash(recoloured) != image_content_hash(palette)
    keyed = palette.copy()
    keyed.info["transparency"] = 0
    assert image_content_hash(keyed) != image_content_hash(palette)
