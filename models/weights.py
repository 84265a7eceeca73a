"""Reading a checkpoint's safetensors and loading them into modules, shared by every family."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from mm_engine.kernels.ops import TorchOps
from mm_engine.models import checkpoint_quant
from mm_engine.models.layers import layer_decode
from mm_engine.models.layers.decoder import DecoderLM
from mm_engine.models.layers.moe import checkpoint_layout
from mm_engine.models.platform import Platform, pack_model_linears, quantize_model_linears
from mm_engine.parallel.group import TPGroup, check_divisible
from mm_engine.parallel.shard import shard_state
from mm_engine.parallel.shard_stored import shard_stored


class WeightRef:
    """One tensor of a safetensors file, read when asked for: whole (`load`) or only a range
    along one dimension (`load_range`, a tensor-parallel shard: the rest is never read)."""

    __slots__ = ("_file", "key")

    def __init__(self, file, key: str) -> None:
        self._file, self.key = file, key

    @property
    def shape(self) -> list[int]:
        return self._file.get_slice(self.key).get_shape()

    def load(self) -> torch.Tensor:
        return self._file.get_tensor(self.key)

    def load_range(self, dim: int, start: int, end: int) -> torch.Tensor:
        part = self._file.get_slice(self.key)
        return part[start:end] if dim == 0 else part[:, start:end]


def read_weights(path: Path) -> dict[str, WeightRef]:
    """Every tensor of the checkpoint by name, as references: a family routes them to its parts
    and each part reads what it needs (`materialize`, or a shard of the language model)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in the model folder {path.name!r}")
    state: dict[str, WeightRef] = {}
    for f in files:
        handle = safe_open(f, framework="pt")
        state.update({key: WeightRef(handle, key) for key in handle.keys()})  # noqa: SIM118 - not a dict
    return state


def materialize(state: dict) -> dict[str, torch.Tensor]:
    return {k: v.load() if hasattr(v, "load") else v for k, v in state.items()}  # a WeightRef, or Dequantized


def split_by_prefix(
    state: dict[str, torch.Tensor], route: Callable[[str], tuple[str, str] | None], family: str
) -> dict[str, dict[str, torch.Tensor]]:
    """`route(key)` names the part a weight belongs to and its key inside that part."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        routed = route(key)
        if routed is None:
            raise ValueError(f"unexpected weight {key!r} in a {family} checkpoint")
        part, name = routed
        parts.setdefault(part, {})[name] = tensor
    return parts


def route_tower_projector_lm(
    key: str, tower: str = "vision_tower.", projector: str = "multi_modal_projector."
) -> tuple[str, str] | None:
    """The LLaVA-style layout (InternVL, Mistral 3): `vision_tower.*`, `multi_modal_projector.*`
    and `language_model.*` (+ `lm_head.*`), under `model.` (transformers 5) or not (older); a
    family may name the first two otherwise (`tower`, `projector`: the prefixes)."""
    k = key.removeprefix("model.")
    for prefix, part in ((tower, "vision"), (projector, "projector")):
        if k.startswith(prefix):
            return part, k.removeprefix(prefix)
    if k.startswith("lm_head."):
        return "lm", k
    if k.startswith("language_model."):
        return "lm", k.removeprefix("language_model.").removeprefix("model.")
    return None


def load_strict(module: nn.Module, state: dict, what: str) -> None:
    missing, unexpected = module.load_state_dict(materialize(state), strict=False)
    # Buffers computed at init and a tied LM head are not stored in checkpoints.
    tied = getattr(module, "tied_lm_head", False)
    missing = [k for k in missing if not k.endswith("inv_freq") and not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(
            f"{what} weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


def build_language_model(
    lm_state: dict[str, torch.Tensor],
    text_config,
    dtype: torch.dtype,
    device: torch.device,
    ops: TorchOps,
    mrope_streams: list[int] | None = None,
    qk_norm: bool = False,
    tp: TPGroup | None = None,
    lm_class: type[DecoderLM] = DecoderLM,
) -> DecoderLM:
    """The engine's paged decoder with the checkpoint's weights; biases, Qwen3's q/k norms and a
    tied head are read from the checkpoint itself. With `tp`, this rank's shard, read as such.
    `lm_class`: the decoder's class (a hybrid model's `HybridLM`)."""
    bias = {p: f"layers.0.self_attn.{p}.bias" in lm_state for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    qk_norm = qk_norm or "layers.0.self_attn.q_norm.weight" in lm_state
    bias["mlp"] = "layers.0.mlp.gate_proj.bias" in lm_state
    tie = "lm_head.weight" not in lm_state
    stored_format, stored = checkpoint_quant.read(text_config), {}
    if stored_format is not None:
        lm_state, stored = stored_format.split(lm_state)
    if getattr(text_config, "num_experts", 0):
        lm_state = checkpoint_layout(lm_state, text_config)
    if tp is not None:
        check_divisible(text_config, tp.world)
    with torch.device(device):
        lm = lm_class(text_config, bias, tie, ops, mrope_streams, qk_norm, tp, dtype)
    if tp is not None:  # the stored weights first: a layer they cannot be split at is named
        stored = shard_stored(stored, lm, tp)
        lm_state = shard_state(lm_state, lm, tp)
    load_strict(lm, lm_state, "language model")
    checkpoint_quant.attach(lm, stored)
    lm.fuse_projections()
    return lm


def ready(model, platform: Platform, pack_weights: bool):
    """Inference mode, the language model's linears quantized where asked and (CPU) packed: the
    last step of every family's loading."""
    model = model.eval().requires_grad_(False)
    quantize_model_linears(model.language_model, platform)
    if pack_weights:
        pack_model_linears(model, model.language_model, platform)
    layer_decode.prepare(model.language_model)  # last: it points at the packed weights
    return model
