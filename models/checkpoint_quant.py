"""Checkpoints stored quantized (`quantization_config` in config.json), read as they are stored.

Loaded: GPTQ and AWQ (models/checkpoint_gptq.py), compressed-tensors' `pack-quantized`
weight-only int4/int8 (`PackQuantized`), and `quant_method: fp8` (transformers' fine-grained FP8,
as the Qwen3-VL and Qwen3.5 `-FP8` checkpoints publish it): each converted linear layer stores
`weight` in float8 e4m3 and `weight_scale_inv`, one float32 scale per block of
`weight_block_size` (128 x 128) of the weight: w = q * scale. Activations are not quantized
("dynamic" activation scales are a GPU kernel's business; here the activations stay float).
Layers without a scale (the `modules_to_not_convert`, the LM head) load as ordinary weights.

Each such layer's weight becomes a `QuantizedWeight` (models/layers/quant_linear.py) with the
checkpoint's own values and its block scales repeated over each block's rows; `attach` hangs it
on the loaded module (`prequantized`) and the quantization step turns that module into a
`QuantLinear` without rounding anything again. Every other `quant_method`, and a layout or option
this does not read, is refused by name: loading one as full precision would give another model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mm_engine.models.checkpoint_gptq import Awq, Gptq, awq_format, gptq_format
from mm_engine.models.checkpoint_stored import load, split, unpack
from mm_engine.models.layers.quant_linear import QuantizedWeight

SCALE = ".weight_scale_inv"


@dataclass(frozen=True, slots=True)
class Fp8Blocks:
    rows: int  # block height (output features)
    cols: int  # block width (input features): the scales' group

    def split(self, state: dict) -> tuple[dict, dict[str, QuantizedWeight]]:
        return split(state, SCALE, self._read)

    def _read(self, out: dict, module: str) -> QuantizedWeight:
        weight = load(out.pop(f"{module}.weight"))
        scales = load(out.pop(f"{module}{SCALE}")).float()
        n, k = weight.shape
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{module}.weight is {weight.dtype}, not float8_e4m3fn, beside its block scales")
        if k % self.cols and k > self.cols:
            raise ValueError(f"{module}: {k} input features are not whole {self.cols}-wide FP8 blocks")
        group = min(self.cols, k)
        per_row = scales.repeat_interleave(self.rows, dim=0)[:n]  # [N, K / group]
        if per_row.shape != (n, -(-k // group)):
            raise ValueError(
                f"{module}: block scales of shape {tuple(scales.shape)} do not fit a {n} x {k} weight"
            )
        return QuantizedWeight("fp8", weight, per_row.contiguous(), None, group)


@dataclass(frozen=True, slots=True)
class PackQuantized:
    """compressed-tensors' `pack-quantized` format (llm-compressor's W4A16 / W8A16): per layer
    `weight_packed` (int32, the values plus 2^(bits-1) packed densely along the input dimension,
    value i at bit i x bits), `weight_shape`, `weight_scale` `[N, K / group]` and, asymmetric,
    `weight_zero_point` (4-bit: packed down the rows): w = (q - zero_point) * scale, both signed
    (here both kept offset, 0..15)."""

    def split(self, state: dict) -> tuple[dict, dict[str, QuantizedWeight]]:
        return split(state, ".weight_packed", self._read)

    def _read(self, out: dict, module: str) -> QuantizedWeight:
        packed = load(out.pop(f"{module}.weight_packed"))
        n, k = (int(v) for v in load(out.pop(f"{module}.weight_shape")).tolist())
        scales = load(out.pop(f"{module}.weight_scale")).float().reshape(n, -1)
        bits = packed.shape[1] * 32 // k
        zero = out.pop(f"{module}.weight_zero_point", None)
        zero = None if zero is None else _zero_points(load(zero), bits, n)
        raw = packed.contiguous().view(torch.uint8)  # little-endian: value i in byte i x bits / 8
        if bits == 4 and k % 2 == 0:
            pairs = raw[:, : k // 2]
            q = torch.stack([pairs & 15, pairs >> 4], dim=-1).reshape(n, k)  # 0..15 = value + 8
            return QuantizedWeight("int4", q, scales, zero, k // scales.shape[1])
        if bits == 8 and zero is None:
            q = (raw[:, :k].to(torch.int16) - 128).to(torch.int8)
            return QuantizedWeight("int8", q, scales, None, k // scales.shape[1])
        kind = f"{bits}-bit" + (" asymmetric" if zero is not None else "")
        raise ValueError(
            f"{module}: {kind} pack-quantized weights are not loaded (4-bit and symmetric 8-bit are)"
        )


def _zero_points(stored: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """Zero points as floats `[N, groups]`, offset like the values (0..15 for 4 bits). 4-bit ones
    are packed down the rows: nibble j of word (r, g) is row 8r + j."""
    if bits != 4 or stored.dtype != torch.int32:
        return stored.float().reshape(rows, -1) + (8 if bits == 4 else 0)
    return unpack(stored, 4, 0)[:rows].float()


def read(config) -> Fp8Blocks | PackQuantized | Gptq | Awq | None:
    """The stored format of a checkpoint's language model (None: full precision); anything this
    engine does not load is refused by its `quant_method`."""
    quant = _quantization_config(config)
    if quant is None:
        return None
    method = quant.get("quant_method")
    if method == "fp8":
        block = quant.get("weight_block_size")
        scheme = quant.get("activation_scheme", "dynamic")
        if block is not None and len(block) == 2 and scheme == "dynamic":
            return Fp8Blocks(int(block[0]), int(block[1]))
        detail = f"weight_block_size={block!r}, activation_scheme={scheme!r}"
        raise ValueError(f"the checkpoint's FP8 layout ({detail}) is not one this engine loads: "
                         "it reads block-scaled FP8 weights with dynamic activations")  # fmt: skip
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    if method == "gptq":
        return gptq_format(quant)
    if method == "awq":
        return awq_format(quant)
    raise ValueError(
        f"the checkpoint is stored quantized (quant_method={str(method)!r}), which this engine does "
        "not load yet (it loads 'fp8', 'gptq', 'awq' and compressed-tensors'); serve the "
        "full-precision checkpoint with quantization='int8', 'int4', 'fp8' or 'bf16' to round it on load"
    )


def _compressed_tensors(quant: dict) -> PackQuantized:
    """The weight-only integer schemes of compressed-tensors' `pack-quantized`; any other format
    or option is refused by name."""
    top, groups = quant.get("format"), quant.get("config_groups") or {}
    if not groups:
        raise ValueError("a compressed-tensors config without config_groups is not loaded")
    for name, group in groups.items():
        fmt = group.get("format") or top
        weights = group.get("weights") or {}
        refusals = {
            "format": fmt if fmt != "pack-quantized" else None,
            "input_activations": group.get("input_activations") or None,
            "output_activations": group.get("output_activations") or None,
            "type": weights.get("type") if weights.get("type") != "int" else None,
            "strategy": weights.get("strategy")
            if weights.get("strategy") not in ("group", "channel")
            else None,
            "actorder": weights.get("actorder") or None,
            "dynamic": weights.get("dynamic") or None,
        }
        for option, value in refusals.items():
            if value is not None:
                raise ValueError(
                    f"compressed-tensors {option}={value!r} (config group {name!r}) is not loaded; "
                    "this engine reads weight-only int4/int8 'pack-quantized' groups"
                )
    return PackQuantized()


def attach(lm: nn.Module, stored: dict[str, QuantizedWeight]) -> None:
    """Each stored weight onto its loaded module, for the quantization step (and the fusion of
    projections, which concatenates them) to find."""
    for path, qw in stored.items():
        try:
            module = lm.get_submodule(path)
        except AttributeError:  # MoE experts, stacked on load: they run at the stored values, in float
            continue
        module.prequantized = qw


def _quantization_config(config) -> dict | None:
    for part in (config, getattr(config, "text_config", None)):
        quant = getattr(part, "quantization_config", None)
        if quant:
            return quant if isinstance(quant, dict) else quant.to_dict()
    return None
