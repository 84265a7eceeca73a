"""The torchvision preprocessing against the model's own transformers image processor.

Images are random noise (not flat colours) so that any difference in interpolation, crop offset,
colour conversion or float arithmetic shows up in the comparison.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, CLIPImageProcessor, LlavaProcessor, SiglipImageProcessor

from mm_engine.testing.common import build_tokenizer
from mm_engine.vision.image_io import ImageError, load_image
from mm_engine.vision.preprocess import ImagePreprocessor, load_image_processor_config

ATOL = 1e-4


def _noise(width: int, height: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    shape = (height, width, channels) if channels > 1 else (height, width)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def _images() -> dict[str, Image.Image]:
    rgba = Image.fromarray(_noise(50, 60, 4, seed=5))  # alpha varies per pixel
    palette = Image.fromarray(_noise(50, 60, seed=6)).convert("RGB").quantize(64)
    keyed_palette = palette.copy()
    keyed_palette.info["transparency"] = 3
    keyed_rgb = Image.fromarray(_noise(50, 60, seed=7))
    keyed_rgb.info["transparency"] = tuple(int(v) for v in np.asarray(keyed_rgb)[0, 0])
    sixteen_bit = np.random.default_rng(8).integers(0, 400, (60, 50), dtype=np.uint16)
    return {
        "square": Image.fromarray(_noise(64, 64, seed=1)),
        "wide": Image.fromarray(_noise(97, 41, seed=2)),
        "tall": Image.fromarray(_noise(41, 97, seed=3)),
        "tiny": Image.fromarray(_noise(3, 5, seed=4)),
        "large": Image.fromarray(_noise(1000, 700, seed=9)),
        "L": Image.fromarray(_noise(50, 60, 1, seed=10)),
        "RGBA": rgba,
        "LA": rgba.convert("LA"),
        "P": palette,
        "P+transparency": keyed_palette,
        "RGB+transparency": keyed_rgb,
        "PA": palette.convert("PA"),
        "1": Image.fromarray(_noise(50, 60, 1, seed=11)).convert("1"),
        "I;16": Image.fromarray(sixteen_bit),
        "CMYK": Image.frombytes("CMYK", (50, 60), _noise(50, 60, 4, seed=12).tobytes()),
    }


IMAGES = _images()

PROCESSORS = {
    "clip-32": lambda: CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
    "clip-default": lambda: CLIPImageProcessor(),
    "siglip-32": lambda: SiglipImageProcessor(size={"height": 32, "width": 32}),
    "siglip-bilinear": lambda: SiglipImageProcessor(size={"height": 48, "width": 40}, resample=2),
    "siglip-nearest": lambda: SiglipImageProcessor(size={"height": 40, "width": 30}, resample=0),
    "clip-crop-pads": lambda: CLIPImageProcessor(do_resize=False, crop_size={"height": 72, "width": 48}),
    "clip-no-normalize": lambda: CLIPImageProcessor(size={"shortest_edge": 24}, do_normalize=False,
                                                    crop_size={"height": 24, "width": 24}),
    "clip-no-rescale": lambda: CLIPImageProcessor(size={"shortest_edge": 24}, do_rescale=False,
                                                  crop_size={"height": 24, "width": 24}),
}  # fmt: skip


def _max_diff(hf, ours: ImagePreprocessor, images: dict[str, Image.Image]) -> float:
    worst = 0.0
    for name, image in images.items():
        expected = hf(image, return_tensors="pt").pixel_values[0]
        got = ours(image)
        assert got.dtype == torch.float32 and got.shape == (3, *ours.output_size), name
        assert got.shape == expected.shape, name
        worst = max(worst, (got - expected.float()).abs().max().item())
    return worst


@pytest.mark.parametrize("make", PROCESSORS.values(), ids=PROCESSORS.keys())
def test_matches_transformers(make):
    hf = make()
    ours = ImagePreprocessor.from_config(hf.to_dict())
    assert _max_diff(hf, ours, IMAGES) <= ATOL


def test_batch_matches_transformers_batch():
    hf = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    ours = ImagePreprocessor.from_config(hf.to_dict())
    images = [IMAGES[k] for k in ("square", "wide", "RGBA", "square", "P", "tiny")]
    expected = hf(images, return_tensors="pt").pixel_values
    got = ours.batch(images)
    assert got.shape == (6, 3, 32, 32)
    assert (got - expected).abs().max().item() <= ATOL
    assert ours.batch([]).shape == (0, 3, 32, 32)


def test_decoded_files_match(tmp_path):
    """Through load_image, as the server sees them: a JPEG and a transparent GIF."""
    hf = SiglipImageProcessor(size={"height": 32, "width": 32})
    ours = ImagePreprocessor.from_config(hf.to_dict())
    IMAGES["large"].save(tmp_path / "a.jpg", quality=80)
    IMAGES["P+transparency"].save(tmp_path / "b.gif")
    decoded = {p.name: load_image(p) for p in (tmp_path / "a.jpg", tmp_path / "b.gif")}
    assert decoded["b.gif"].mode == "P"
    assert _max_diff(hf, ours, decoded) <= ATOL


def test_old_style_int_sizes_match():
    cfg = {"image_processor_type": "CLIPImageProcessor", "size": 40, "crop_size": 36}
    hf = CLIPImageProcessor.from_dict(cfg)
    ours = ImagePreprocessor.from_config(cfg)
    assert ours.size == 40 and ours.output_size == (36, 36)
    assert _max_diff(hf, ours, {k: IMAGES[k] for k in ("wide", "tall")}) <= ATOL


def test_config_from_preprocessor_config(tmp_path):
    hf = SiglipImageProcessor(size={"height": 32, "width": 32})
    hf.save_pretrained(tmp_path)
    cfg = load_image_processor_config(tmp_path)
    assert cfg["image_processor_type"] == "SiglipImageProcessor"
    ours = ImagePreprocessor.from_config(cfg)
    assert ours.output_size == (32, 32)
    assert _max_diff(hf, ours, {"wide": IMAGES["wide"]}) <= ATOL


def test_config_from_llava_processor(tmp_path):
    improc = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    LlavaProcessor(image_processor=improc, tokenizer=build_tokenizer(), patch_size=8).save_pretrained(
        tmp_path
    )
    assert not (tmp_path / "preprocessor_config.json").exists()  # nested in processor_config.json
    ours = ImagePreprocessor.from_config(load_image_processor_config(tmp_path))
    hf = AutoProcessor.from_pretrained(tmp_path).image_processor
    assert _max_diff(hf, ours, {k: IMAGES[k] for k in ("tall", "RGBA")}) <= ATOL


def test_nested_config_wins_like_transformers(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"size": {"shortest_edge": 1}}))
    nested = {"image_processor_type": "SiglipImageProcessor", "size": {"height": 8, "width": 8}}
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": nested}))
    assert load_image_processor_config(tmp_path) == nested


def test_missing_config_names_both_files(tmp_path):
    (tmp_path / "processor_config.json").write_text(json.dumps({"processor_class": "LlavaProcessor"}))
    with pytest.raises(ValueError, match=r"preprocessor_config\.json.*processor_config\.json"):
        load_image_processor_config(tmp_path)


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({"image_processor_type": "LlavaNextImageProcessor"}, "CLIPImageProcessor and SiglipImageProcessor"),
        ({}, "CLIPImageProcessor and SiglipImageProcessor"),
        ({"image_processor_type": "CLIPImageProcessor", "do_pad": True}, "do_pad"),
        ({"image_processor_type": "CLIPImageProcessor", "image_grid_pinpoints": [[336, 672]]}, "pinpoints"),
        ({"image_processor_type": "CLIPImageProcessor", "resample": 1}, "bicubic"),
        ({"image_processor_type": "SiglipImageProcessor", "size": {"longest_edge": 64}}, "shortest_edge"),
        ({"image_processor_type": "SiglipImageProcessor", "size": {"shortest_edge": 64}}, "output size"),
        ({"image_processor_type": "CLIPImageProcessor", "image_mean": [0.5, 0.5]}, "3 values"),
    ],
)
def test_unsupported_configs_are_refused(cfg, match):
    with pytest.raises(ValueError, match=match):
        ImagePreprocessor.from_config(cfg)


def test_fast_and_legacy_type_names_are_accepted():
    for name in ("CLIPImageProcessorFast", "CLIPFeatureExtractor"):
        assert ImagePreprocessor.from_config({"image_processor_type": name}).output_size == (224, 224)


def test_settings_key_is_stable_and_tells_settings_apart():
    clip = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).to_dict()
    a = ImagePreprocessor.from_config(clip)
    assert a.settings_key() == ImagePreprocessor.from_config(json.loads(json.dumps(clip))).settings_key()
    assert isinstance(a.settings_key(), bytes)
    others = [
        clip | {"resample": 2},
        clip | {"image_mean": [0.5, 0.5, 0.5]},
        clip | {"size": {"shortest_edge": 33}},
    ]
    keys = {ImagePreprocessor.from_config(c).settings_key() for c in others}
    assert len(keys | {a.settings_key()}) == 4


def test_non_rgb_image_refused_when_processor_does_not_convert():
    ours = ImagePreprocessor.from_config(
        {"image_processor_type": "SiglipImageProcessor", "do_convert_rgb": False}
    )
    assert ours(IMAGES["square"]).shape == (3, 224, 224)
    with pytest.raises(ImageError, match="mode L"):
        ours(IMAGES["L"])
