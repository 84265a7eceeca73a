"""Tiny GPTQ and AWQ checkpoints, packed by hand following the formats' documented layouts (no
GPTQ/AWQ library is installed), and their dequantized twins: ordinary checkpoints whose weights
are the values the packed ones stand for, for transformers to run as the reference.

The weights are rounded to nearest (min/max per group), not by the GPTQ or AWQ algorithms: the
layout is what is under test. Scales are float16, as the formats store them, and the twin's
weights are computed from the same integers, zero points and float16 scales."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def language_projections(state: dict[str, torch.Tensor]) -> list[str]:
    """The keys of the language model's projection weights (`*_proj`, Qwen3.5's `in_proj_*` too;
    the vision tower's and projector's left out, and any with fewer than 8 outputs or a number not
    whole int32 words of zero points, which a quantizer leaves as they are): the layers a quantized
    checkpoint of a VL model stores quantized."""
    vision = ("visual", "vision", "merger", "projector")
    return [
        k
        for k, w in state.items()
        if k.endswith(".weight")
        and "proj" in k.split(".")[-2]
        and w.dim() == 2
        and w.shape[0] % 8 == 0
        and not any(v in k for v in vision)
    ]


def round_groups(w: torch.Tensor, g_idx: torch.Tensor, bits: int, symmetric: bool):
    """`w` `[N, K]` rounded per output row and group (`g_idx`: each input's group): unsigned
    values `[N, K]`, zero points and float16 scales `[groups, N]`; w ~ (q - zero) x scale."""
    top, groups = 2**bits - 1, int(g_idx.max()) + 1
    low = torch.stack([w[:, g_idx == g].amin(1) for g in range(groups)]).clamp(max=0)  # [groups, N]
    high = torch.stack([w[:, g_idx == g].amax(1) for g in range(groups)]).clamp(min=0)
    if symmetric:
        zero = torch.full_like(low, 2 ** (bits - 1))
        scale = torch.maximum(-low, high) / (2 ** (bits - 1) - 1)
    else:
        scale = (high - low) / top
    scale = scale.clamp(min=1e-5).half()
    if not symmetric:
        zero = (-low / scale.float()).round().clamp(0, top)
    q = (w / scale.float()[g_idx].T + zero[g_idx].T).round().clamp(0, top)
    return q.long(), zero.long(), scale


def dequantize(q, zero, scale, g_idx) -> torch.Tensor:
    return (q - zero[g_idx].T).float() * scale.float()[g_idx].T


def pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned `values` into int32 words along `dim` (value i of a word at bit i x bits)."""
    per = 32 // bits
    v = values.movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, per).long()
    words = sum(v[..., i] << (bits * i) for i in range(per))
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def gptq_layer(w: torch.Tensor, bits: int, group: int, symmetric: bool, order: torch.Tensor | None, v1: bool):
    """GPTQ tensors of `w` `[N, K]` (`order`: act-order's input order, None: natural) and the
    weight they stand for."""
    k = w.shape[1]
    g_idx = torch.arange(k) // group
    if order is not None:  # the i-th input in act-order is in group i // group
        g_idx = torch.empty_like(g_idx).index_copy_(0, order, g_idx)
    q, zero, scale = round_groups(w, g_idx, bits, symmetric)
    stored_zero = (zero - 1) & (2**bits - 1) if v1 else zero  # v1: minus one, wrapping like GPTQ's
    tensors = {
        "qweight": pack(q.T, bits, 0),
        "qzeros": pack(stored_zero, bits, 1),
        "scales": scale,
        "g_idx": g_idx.to(torch.int32),
    }
    return tensors, dequantize(q, zero, scale, g_idx)


def awq_layer(w: torch.Tensor, group: int):
    """AWQ (gemm) tensors of `w` `[N, K]` and the weight they stand for."""
    g_idx = torch.arange(w.shape[1]) // group
    q, zero, scale = round_groups(w, g_idx, 4, symmetric=False)

    def interleave(t):  # [rows, N]: each 8 columns in the nibble order of AWQ
        return t.view(t.shape[0], -1, 8)[..., list(AWQ_ORDER)].flatten(1)

    tensors = {
        "qweight": pack(interleave(q.T), 4, 1),
        "qzeros": pack(interleave(zero), 4, 1),
        "scales": scale,
    }
    return tensors, dequantize(q, zero, scale, g_idx)


def write_checkpoints(path, out: Path, quantization_config: dict, layer) -> tuple[str, str]:
    """The checkpoint at `path` with each language-model projection stored by `layer(key, w)`
    (its tensors, and the weight they stand for), and the twin with those weights: (packed, twin)."""
    packed, twin = shutil.copytree(path, out / "packed"), shutil.copytree(path, out / "twin")
    state = load_file(str(packed / "model.safetensors"))
    stored, plain = dict(state), dict(state)
    for key in language_projections(state):
        module = key.removesuffix(".weight")
        tensors, plain[key] = layer(key, state[key])
        del stored[key]
        stored.update({f"{module}.{name}": t for name, t in tensors.items()})
    save_file(stored, str(packed / "model.safetensors"), metadata={"format": "pt"})
    save_file(plain, str(twin / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((packed / "config.json").read_text())
    (packed / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return str(packed), str(twin)


def gptq_checkpoint(path, out: Path, bits: int, group: int, symmetric: bool, act_order: str | None):
    """A GPTQ (v1) copy of the checkpoint at `path` and its twin. `act_order`: None, "shared" (one
    random input order for the layers that read the same input, as GPTQ gives them) or "each"
    (one per layer)."""
    orders: dict[tuple[str, int], torch.Tensor] = {}
    gen = torch.Generator().manual_seed(0)

    def layer(key: str, w: torch.Tensor):
        k = w.shape[1]
        input_of = (key.rsplit(".", 2)[0] if act_order == "shared" else key, k)
        order = None
        if act_order is not None:
            order = orders.setdefault(input_of, torch.randperm(k, generator=gen))
        return gptq_layer(w, bits, k if group == -1 else group, symmetric, order, v1=True)

    config = {
        "quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order is not None,
        "sym": symmetric, "checkpoint_format": "gptq",
    }  # fmt: skip
    return write_checkpoints(path, out, config, layer)


def awq_checkpoint(path, out: Path, group: int):
    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    return write_checkpoints(path, out, config, lambda key, w: awq_layer(w, group))
