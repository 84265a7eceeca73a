"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, as llm-compressor saves
them): the formats this engine reads, and the refusal of the rest by name.

`pack-quantized` (W4A16 / W8A16, `PackQuantized`): int4/int8 weights packed in int32 words.
`float-quantized`, `int-quantized` and `naive-quantized` (`Unpacked`): each layer's `weight` as
float8 e4m3 (FP8, FP8_DYNAMIC, FP8_BLOCK weights) or int8 (W8A8) values, symmetric, with
`weight_scale` per tensor `[1]`, per output channel `[N, 1]`, per group `[N, K / group]` or per
block `[N / rows, K / cols]`; the input quantized dynamically per token (int8 or fp8) or
statically per tensor at the stored `input_scale` (fp8 or int8), as models/layers/act_quant.py
does it. Layers in the config's `ignore` list are stored as plain weights and load as such (the
readers find quantized layers by their stored scales).

Refused by name: asymmetric or activation-ordered weights in the unpacked formats, input
quantization per tensor computed at run time or per group, asymmetric inputs, output
activations, a KV cache scheme, config groups with different formats or input schemes, and every
other format (sparse, marlin-24, nvfp4, mxfp4 ...).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mm_engine.models.checkpoint_stored import block_scales, load, split, unpack
from mm_engine.models.layers.quant_linear import QuantizedWeight

UNPACKED = ("float-quantized", "int-quantized", "naive-quantized")
_KINDS = {("float", 8): "fp8", ("int", 8): "int8"}


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


@dataclass(frozen=True, slots=True)
class Unpacked:
    """The unpacked formats (module docstring). `block`: the weights' block shape, for
    strategy block; `act`: the input's quantization kind (None: float), `static`: at a stored
    per-tensor scale rather than per token."""

    block: tuple[int, int] | None
    act: str | None
    static: bool

    def split(self, state: dict) -> tuple[dict, dict[str, QuantizedWeight]]:
        return split(state, ".weight_scale", self._read)

    def _read(self, out: dict, module: str) -> QuantizedWeight:
        weight = load(out.pop(f"{module}.weight"))
        scale = load(out.pop(f"{module}.weight_scale")).float()
        for name in ("weight_zero_point", "input_zero_point"):
            zero = out.pop(f"{module}.{name}", None)
            if zero is not None and bool(load(zero).float().any()):
                raise ValueError(f"{module}: a nonzero {name} (asymmetric) is not loaded")
        act_scale = out.pop(f"{module}.input_scale", None)
        if self.static and act_scale is None:
            raise ValueError(f"{module}: static input quantization without a stored input_scale")
        act_scale = load(act_scale).float().reshape(()) if self.static else None
        kind = {torch.float8_e4m3fn: "fp8", torch.int8: "int8"}.get(weight.dtype)
        if kind is None:
            raise ValueError(f"{module}.weight is stored as {weight.dtype}, not float8_e4m3fn or int8")
        n, k = weight.shape
        if self.block is not None:
            scales, group = block_scales(module, scale, *self.block, n, k)
        else:  # per tensor, channel or group
            scales = scale.reshape(1, 1).expand(n, 1) if scale.numel() == 1 else scale.reshape(n, -1)
            group = k // scales.shape[1]
        return QuantizedWeight(kind, weight, scales.contiguous(), None, group, None, self.act, act_scale)


def compressed_tensors_format(quant: dict) -> PackQuantized | Unpacked:
    """The reader of a compressed-tensors config; any format or option it does not read is
    refused by name."""
    top, groups = quant.get("format"), quant.get("config_groups") or {}
    if not groups:
        raise ValueError("a compressed-tensors config without config_groups is not loaded")
    if quant.get("kv_cache_scheme"):
        raise ValueError("a compressed-tensors kv_cache_scheme is not loaded")
    readers = {_group_reader(name, group, group.get("format") or top) for name, group in groups.items()}
    if len(readers) > 1:
        raise ValueError(
            "compressed-tensors config groups with different formats or input quantizations are not "
            f"loaded together: {sorted(groups)}"
        )
    return readers.pop()


def _group_reader(name: str, group: dict, fmt: str | None) -> PackQuantized | Unpacked:
    weights, inputs = group.get("weights") or {}, group.get("input_activations") or None
    kind = _KINDS.get((weights.get("type"), weights.get("num_bits")))
    strategy = weights.get("strategy")
    refusals = {
        "format": fmt if fmt != "pack-quantized" and fmt not in UNPACKED else None,
        "output_activations": group.get("output_activations") or None,
        "actorder": weights.get("actorder") or None,
        "dynamic": weights.get("dynamic") or None,
    }
    if fmt == "pack-quantized":
        refusals |= {
            "input_activations": inputs,
            "type": weights.get("type") if weights.get("type") != "int" else None,
            "strategy": strategy if strategy not in ("group", "channel") else None,
        }
    else:
        refusals |= {
            "weights": None if kind else f"{weights.get('type')} {weights.get('num_bits')}-bit",
            "symmetric": False if weights.get("symmetric") is False else None,
            "strategy": strategy if strategy not in ("tensor", "channel", "group", "block") else None,
        }
        if inputs is not None:
            static, act = not inputs.get("dynamic"), _KINDS.get((inputs.get("type"), inputs.get("num_bits")))
            got, wanted = inputs.get("strategy"), "tensor" if static else "token"
            refusals |= {
                "input_activations": None if act else f"{inputs.get('type')} {inputs.get('num_bits')}-bit",
                "input_activations.strategy": None if got == wanted else got,
                "input_activations.symmetric": False if inputs.get("symmetric") is False else None,
            }
    for option, value in refusals.items():
        if value is not None:
            raise ValueError(
                f"compressed-tensors {option}={value!r} (config group {name!r}) is not loaded; this "
                "engine reads weight-only int4/int8 'pack-quantized' groups and symmetric fp8/int8 "
                "'float-quantized'/'int-quantized' ones (inputs float, dynamic per token, or static "
                "per tensor)"
            )
    if fmt == "pack-quantized":
        return PackQuantized()
    block = tuple(weights["block_structure"]) if strategy == "block" else None
    if inputs is None:
        return Unpacked(block, None, False)
    return Unpacked(block, _KINDS[(inputs["type"], inputs["num_bits"])], not inputs.get("dynamic"))
