"""Tiny compressed-tensors `pack-quantized` checkpoints written by the compressed-tensors library
itself (the llm-compressor save path: apply_quantization_config, min/max qparams through
calculate_qparams, ModelCompressor.compress_model + update_config), and their dequantized twins
(the library's own checkpoint dequantizer), for tests of the engine's compressed-tensors loader."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.entrypoints.convert import convert_checkpoint
from compressed_tensors.entrypoints.convert.converters import CompressedTensorsDequantizer
from compressed_tensors.offload import update_offload_parameter
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams, is_module_quantized
from safetensors.torch import load_file, save_file

# Everything but the language model's Linears: the vision tower with its merger/projector, the head.
IGNORE = [
    "re:.*lm_head$",
    "re:.*visual.*",
    "re:.*vision_tower.*",
    "re:.*vision_model.*",
    "re:.*multi_modal_projector.*",
]
_WEIGHT_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json")


def pack_quantized_checkpoint(
    path: str | Path, out_dir: str | Path, num_bits: int, group_size: int | None, symmetric: bool
) -> None:
    """Write to `out_dir` the checkpoint at `path` with every language-model Linear quantized to
    `num_bits`-bit ints (weight-only, per group of `group_size` inputs or, when None, per output
    channel; min/max qparams as llm-compressor's default observer), saved as the library saves it
    in the `pack-quantized` format; the tokenizer, processor and chat template files are copied."""
    from transformers import AutoModelForImageTextToText

    path, out_dir = Path(path), Path(out_dir)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype="auto")
    weights = QuantizationArgs(
        num_bits=num_bits,
        type="int",
        symmetric=symmetric,
        strategy="group" if group_size else "channel",
        group_size=group_size,
        dynamic=False,
        actorder=None,
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=IGNORE)
    apply_quantization_config(model, config, show_progress=False)
    for module in model.modules():
        if not is_module_quantized(module):
            continue
        weight = module.weight.detach()
        if group_size:
            weight = weight.unflatten(-1, (-1, group_size))  # (rows, groups, group_size)
        low, high = weight.amin(-1, keepdim=not group_size), weight.amax(-1, keepdim=not group_size)
        scale, zero_point = calculate_qparams(low, high, module.quantization_scheme.weights)
        update_offload_parameter(module, "weight_scale", scale)
        update_offload_parameter(module, "weight_zero_point", zero_point)
        module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    shutil.copytree(path, out_dir, ignore=shutil.ignore_patterns(*_WEIGHT_FILES), dirs_exist_ok=True)
    model.save_pretrained(out_dir)
    compressor.update_config(str(out_dir))


class _Dequantizer(CompressedTensorsDequantizer):
    """The library's dequantizer, its zero points handed over column-major: its 4-bit unpack
    (`unpack_from_int32(..., packed_dim=0)`) views the transposed tensor as bytes, which fails when
    the zero points pack into one row (8 or fewer output rows, e.g. Qwen3.5's tiny in_proj_a/b)."""

    def process(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for name, zero_point in tensors.items():
            if name.endswith(".weight_zero_point") and zero_point.ndim == 2:
                column_major = zero_point.new_empty_strided(zero_point.shape, (1, zero_point.shape[0]))
                tensors[name] = column_major.copy_(zero_point)
        return super().process(tensors)


def dequantized_twin(out_dir: str | Path, twin_dir: str | Path) -> None:
    """Write to `twin_dir` a float32 copy of the compressed checkpoint `out_dir` whose quantized
    weights are the library's own decompressed ones (its checkpoint dequantizer) and whose
    config.json has no `quantization_config`: an ordinary transformers checkpoint."""
    dequantizer = _Dequantizer(out_dir, dtype=torch.float32)
    convert_checkpoint(out_dir, twin_dir, dequantizer, max_workers=1, device="cpu")
    for file in Path(twin_dir).glob("*.safetensors"):
        tensors = load_file(file)
        floats = {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}
        save_file(floats, file, metadata={"format": "pt"})
