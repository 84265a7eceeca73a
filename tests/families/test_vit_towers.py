"""The engine's own fixed-resolution towers (models/layers/vit_tower.py: CLIP, SigLIP, Idefics3's
NaViT SigLIP, InternViT) and Pixtral (models/layers/pixtral_tower.py): each family's loaded tower
is the engine's, and its features equal transformers' tower on the same pixels (several images in
one call), on the torch ops and on every C kernel; InternViT's options the tiny checkpoints do not
use (q/k norm, RMSNorm blocks, biased q/k/v, a final norm, an inner feature layer) module by
module; the position tables against transformers' own."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel

from helpers.families import engine
from mm_engine.kernels.ops import TorchOps
from mm_engine.models.layers.pixtral_tower import PixtralTower, pixtral_rotary
from mm_engine.models.layers.vit_tower import Embeddings, VitSpec, VitTower, tower_state

FAMILIES = ["gemma3", "idefics3", "smolvlm", "internvl", "mistral3", "llava_next", "llava_onevision"]


def _pixels(n: int, side: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 3, side, side, generator=torch.Generator().manual_seed(seed))


def _towers(name: str, model, ref):
    """(ours, theirs, pixels) -> (our features, transformers') for one family."""
    hf = ref.model.model
    if name in ("idefics3", "smolvlm"):
        side = hf.vision_model.config.image_size
        px = _pixels(5, side, 1)
        return model.vision_model(px)[0], hf.vision_model(pixel_values=px).last_hidden_state
    if name == "mistral3":
        sizes = [(32, 48), (16, 16), (48, 24)]
        g = torch.Generator().manual_seed(2)
        images = [torch.randn(3, h, w, generator=g) for h, w in sizes]
        padded = torch.zeros(len(images), 3, 48, 48)
        for i, image in enumerate(images):
            padded[i, :, : image.shape[1], : image.shape[2]] = image
        out = hf.vision_tower(padded, image_sizes=torch.tensor(sizes), output_hidden_states=True)
        layer = model.config.vision_feature_layer
        return model.vision_tower(images)[0], out.hidden_states[layer][0]
    side = hf.vision_tower.config.image_size
    side = side if isinstance(side, int) else side[0]
    px = _pixels(4, side, 3)
    if name.startswith("llava"):
        out = hf.vision_tower(px, output_hidden_states=True)
        return torch.cat(model.vision_tower(px), -1), torch.cat(
            [out.hidden_states[i] for i in model.layers], -1
        )
    return model.vision_tower(px)[0], hf.vision_tower(pixel_values=px).last_hidden_state


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("name", FAMILIES)
def test_family_tower_is_the_engines_and_equals_transformers(vl_family, name, backend):
    path, ref = vl_family(name)
    llm = engine(path, backend, **({"cpu_kernels": "all"} if backend == "cpu" else {}))
    model = llm.engine.core.model
    tower = model.vision_model if name in ("idefics3", "smolvlm") else model.vision_tower
    assert isinstance(tower, VitTower | PixtralTower)
    assert not any(isinstance(m, PreTrainedModel) for m in tower.modules())
    with torch.inference_mode():
        got, want = _towers(name, model, ref)
    assert got.shape == want.shape
    # The tiny checkpoints' weights are large (activations up to ~100): float32 rounding, scaled.
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * max(1.0, want.abs().max().item()))
    llm.close()


INTERNVIT_OPTIONS = [
    dict(use_qk_norm=True),
    dict(norm_type="rms_norm", attention_bias=True),
    dict(use_mean_pooling=False),
    dict(use_qk_norm=True, norm_type="rms_norm", use_mean_pooling=False, feature_layer=-2),
]


@pytest.mark.parametrize("options", INTERNVIT_OPTIONS, ids=lambda o: "-".join(o))
def test_internvit_options_equal_transformers(options):
    from transformers.models.internvl.configuration_internvl import InternVLVisionConfig
    from transformers.models.internvl.modeling_internvl import InternVLVisionModel

    options = dict(options)
    layer = options.pop("feature_layer", -1)
    config = InternVLVisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        image_size=[32, 32], patch_size=[8, 8], layer_scale_init_value=0.5, **options,
    )  # fmt: skip
    torch.manual_seed(0)
    theirs = InternVLVisionModel._from_config(config).eval()
    with torch.no_grad():  # random scales, norms and class token: nothing left at its neutral value
        for name, p in theirs.named_parameters():
            if "lambda" in name or "norm" in name or "cls" in name or "position" in name:
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "lambda" in name or "norm" in name else 0.0))
    depth = 3 if layer == -1 else 3 + 1 + layer
    post_norm = layer == -1 and not config.use_mean_pooling
    ours = VitTower(config, [depth], TorchOps(), post_norm=post_norm).eval()
    missing, unexpected = ours.load_state_dict(
        tower_state(theirs.state_dict(), depth, "internvit", post_norm)
    )
    assert not missing and not unexpected
    px = _pixels(3, 32, 5)
    with torch.inference_mode():
        out = theirs(pixel_values=px, output_hidden_states=True)
        want = out.last_hidden_state if layer == -1 else out.hidden_states[layer]
        torch.testing.assert_close(ours(px)[0], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("image", "patch"), [(378, 14), (384, 16), (512, 16), (364, 14), (32, 8)])
def test_navit_positions_equal_transformers_buckets(image, patch):
    """Idefics3 / SmolVLM tiles of the published sizes: the bucketed position ids of a whole tile,
    read off transformers' embeddings with a position table that holds each row's index."""
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionEmbeddings

    config = Idefics3VisionConfig(hidden_size=8, image_size=image, patch_size=patch)
    theirs = Idefics3VisionEmbeddings(config)
    with torch.no_grad():
        theirs.patch_embedding.weight.zero_()
        theirs.patch_embedding.bias.zero_()
        theirs.position_embedding.weight.copy_(
            torch.arange(theirs.num_positions).float()[:, None].expand(-1, 8)
        )
    side = image // patch
    mask = torch.ones(1, side, side, dtype=torch.bool)
    with torch.inference_mode():
        want = theirs(torch.zeros(1, 3, image, image), mask)[0, :, 0].long()
    assert torch.equal(Embeddings(config, VitSpec.of(config)).positions(), want)


def test_pixtral_rotary_equals_transformers():
    from transformers.models.pixtral.configuration_pixtral import PixtralVisionConfig
    from transformers.models.pixtral.modeling_pixtral import PixtralVisionRotaryEmbedding

    config = PixtralVisionConfig(hidden_size=128, num_attention_heads=2, head_dim=64)
    grids = [(3, 5), (1, 7), (4, 4)]
    positions = torch.cat(
        [torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1).reshape(-1, 2)
         for h, w in grids]
    )  # fmt: skip
    cos, sin = PixtralVisionRotaryEmbedding(config)(torch.zeros(1), positions)
    ours_cos, ours_sin = pixtral_rotary(grids, 64, config.rope_parameters["rope_theta"])
    torch.testing.assert_close(torch.cat([ours_cos[:, 0]] * 2, -1), cos)
    torch.testing.assert_close(torch.cat([ours_sin[:, 0]] * 2, -1), sin)


def test_towers_refuse_what_they_cannot_take():
    from transformers import SiglipVisionConfig

    config = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                num_attention_heads=2, image_size=32, patch_size=8)  # fmt: skip
    tower = VitTower(config, [2], TorchOps())
    with pytest.raises(ValueError, match="32x32 pixels"):
        tower(torch.zeros(1, 3, 32, 40))
    with pytest.raises(ValueError, match="last block only"):
        VitTower(config, [1], TorchOps(), post_norm=True)


def test_idefics3_processing_refuses_a_tile_padded_inside(vl_family, monkeypatch):
    """The engine's NaViT tower takes whole tiles: an image processor that pads inside one (a
    pixel mask with holes) is refused by name rather than encoded as if the padding were pixels."""
    from PIL import Image
    from transformers import AutoConfig, AutoTokenizer

    from mm_engine.models.idefics3 import Idefics3Processing

    path, _ = vl_family("idefics3")
    ours = Idefics3Processing(path, AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path))
    image = Image.new("RGB", (40, 30), (10, 20, 30))
    ours.process(image)  # whole tiles: taken
    real = ours.hf

    def padded(*args, **kwargs):
        out = real(*args, **kwargs)
        out["pixel_attention_mask"] = torch.ones_like(out["pixel_attention_mask"])
        out["pixel_attention_mask"][..., -1, :] = 0
        return out

    monkeypatch.setattr(ours, "hf", padded)
    with pytest.raises(ValueError, match="padded inside a tile"):
        ours.process(image)
