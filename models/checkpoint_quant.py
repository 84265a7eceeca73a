"""Checkpoints stored quantized (`quantization_config` in config.json), read as they are stored.

Loaded: GPTQ and AWQ (models/checkpoint_gptq.py), compressed-tensors' `pack-quantized`,
`float-quantized` and `int-quantized` (models/checkpoint_compressed.py), and `quant_method: fp8`
(transformers' fine-grained FP8, as the Qwen3-VL and Qwen3.5 `-FP8` checkpoints publish it):
each converted linear layer stores `weight` in float8 e4m3 and `weight_scale_inv`, one float32
scale per block of `weight_block_size` (128 x 128) of the weight: w = q * scale. Its activations
are not quantized (its "dynamic" activation scales are a GPU kernel's business; here the
activations stay float). Layers without a scale (the `modules_to_not_convert`, the LM head) load
as ordinary weights.

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

from mm_engine.models.checkpoint_compressed import PackQuantized, Unpacked, compressed_tensors_format
from mm_engine.models.checkpoint_gptq import Awq, Gptq, awq_format, gptq_format
from mm_engine.models.checkpoint_stored import block_scales, load, split
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
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{module}.weight is {weight.dtype}, not float8_e4m3fn, beside its block scales")
        per_row, group = block_scales(module, scales, self.rows, self.cols, *weight.shape)
        return QuantizedWeight("fp8", weight, per_row, None, group)


def read(config) -> Fp8Blocks | PackQuantized | Unpacked | Gptq | Awq | None:
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
        return compressed_tensors_format(quant)
    if method == "gptq":
        return gptq_format(quant)
    if method == "awq":
        return awq_format(quant)
    raise ValueError(
        f"the checkpoint is stored quantized (quant_method={str(method)!r}), which this engine does "
        "not load yet (it loads 'fp8', 'gptq', 'awq' and compressed-tensors'); serve the "
        "full-precision checkpoint with quantization='int8', 'int4', 'fp8' or 'bf16' to round it on load"
    )


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
