"""Load a LLaVA checkpoint from a Hugging Face folder (or the Hub, when the name is no folder).

Two key layouts are found in the wild: the original one (`language_model.model.*`,
`language_model.lm_head.*`, `vision_tower.vision_model.*`, `multi_modal_projector.*`) and the one
transformers writes since 4.52 (`model.language_model.*`, `model.vision_tower.*`,
`model.multi_modal_projector.*`, `lm_head.*`). Both are renamed to one canonical set of names.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModel

from mm_engine.layers import DecoderLM
from mm_engine.model import LlavaModel
from mm_engine.platform import Platform, adapt_vision_tower, make_platform, pack_model_linears

SUPPORTED_ARCHITECTURES = ("LlavaForConditionalGeneration",)
SUPPORTED_TEXT = ("llama", "mistral", "qwen2")
SUPPORTED_VISION = ("clip_vision_model", "siglip_vision_model")


def resolve_model_path(model: str | Path) -> Path:
    """A local folder as it is; anything else is fetched from the Hugging Face Hub."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"model must be a checkpoint folder or a Hub model name, not a file: {path.name}")
    from huggingface_hub import snapshot_download

    try:
        patterns = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]
        return Path(snapshot_download(str(model), allow_patterns=patterns))
    except Exception as exc:  # network off, unknown repo, ...: say which, without internals
        raise ValueError(
            f"model {str(model)!r} is not a local folder and could not be downloaded ({type(exc).__name__})"
        ) from None


def load_config(path: Path):
    if not (path / "config.json").is_file():
        raise ValueError(f"no config.json in the model folder {path.name!r}")
    config = AutoConfig.from_pretrained(path)
    archs = getattr(config, "architectures", None) or []
    if config.model_type != "llava" or (archs and archs[0] not in SUPPORTED_ARCHITECTURES):
        raise ValueError(
            f"unsupported architecture {archs[0] if archs else config.model_type!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)} with a {'/'.join(SUPPORTED_VISION)} vision "
            f"tower and a {'/'.join(SUPPORTED_TEXT)} language model"
        )
    if config.text_config.model_type not in SUPPORTED_TEXT:
        raise ValueError(
            f"unsupported language model {config.text_config.model_type!r}; supported: {SUPPORTED_TEXT}"
        )
    if config.vision_config.model_type not in SUPPORTED_VISION:
        raise ValueError(
            f"unsupported vision tower {config.vision_config.model_type!r}; supported: {SUPPORTED_VISION}"
        )
    return config


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in the model folder {path.name!r}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


def split_weights(state: dict[str, torch.Tensor]) -> tuple[dict, dict, dict]:
    """Canonical (vision tower, projector, language model) state dicts from either layout."""
    vision, projector, lm = {}, {}, {}
    for key, tensor in state.items():
        k = key.removeprefix("model.")
        if k.startswith("lm_head."):
            lm[k] = tensor
        elif k.startswith("language_model."):
            rest = k.removeprefix("language_model.")
            lm[rest if rest.startswith("lm_head.") else rest.removeprefix("model.")] = tensor
        elif k.startswith("vision_tower."):
            vision[k.removeprefix("vision_tower.").removeprefix("vision_model.")] = tensor
        elif k.startswith("multi_modal_projector."):
            projector[k.removeprefix("multi_modal_projector.")] = tensor
        else:
            raise ValueError(f"unexpected weight {key!r} in a LLaVA checkpoint")
    return vision, projector, lm


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _load(module: torch.nn.Module, state: dict, what: str) -> None:
    missing, unexpected = module.load_state_dict(state, strict=False)
    # Buffers computed at init and a tied LM head are not stored in checkpoints.
    tied = getattr(module, "tied_lm_head", False)
    missing = [k for k in missing if not k.endswith("inv_freq") and not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(
            f"{what} weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


def load_model(
    path: Path,
    config,
    dtype: torch.dtype,
    vision_dtype: torch.dtype,
    device: torch.device,
    pack_weights: bool = False,
    platform: Platform | None = None,
) -> LlavaModel:
    """The model on `platform` (default: the torch path on `device`): its layers call the
    platform's ops, and a vision tower's attention and GELU go through them where it has faster
    ones. `pack_weights`: on CPU, every linear layer runs with a packed weight, the language
    model's through the platform's C GEMM where it uses one (faster at decode's few rows), the
    rest through oneDNN (`mm_engine.packed_linear`); elsewhere it changes nothing."""
    platform = platform or make_platform(device, "torch")
    vision_state, projector_state, lm_state = split_weights(read_weights(path))
    bias = {p: f"layers.0.self_attn.{p}.bias" in lm_state for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    bias["mlp"] = "layers.0.mlp.gate_proj.bias" in lm_state
    tie = "lm_head.weight" not in lm_state
    with torch.device(device), _default_dtype(dtype):
        lm = DecoderLM(config.text_config, bias, tie_embeddings=tie, ops=platform.ops)
    _load(lm, lm_state, "language model")
    lm.fuse_projections()
    tower = AutoModel.from_config(config.vision_config).to(device=device, dtype=vision_dtype)
    _load(tower, vision_state, "vision tower")
    with torch.device(device), _default_dtype(dtype):
        model = LlavaModel(config, tower, lm, projector_bias="linear_1.bias" in projector_state)
    _load(model.multi_modal_projector, projector_state, "projector")
    model = model.eval().requires_grad_(False)
    adapt_vision_tower(model.vision_tower, platform)
    if pack_weights:
        pack_model_linears(model, model.language_model, platform)
    return model
