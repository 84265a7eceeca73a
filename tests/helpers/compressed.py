"""Tiny compressed-tensors `pack-quantized` checkpoints written by the compressed-tensors library
itself (the llm-compressor save path: apply_quantization_config, min/max qparams through
calculate_qparams, ModelCompressor.compress_model + update_config), and their dequantized twins
(the library's own checkpoint dequantizer), for tests of the engine's compressed-tensors loader."""

from __future__ import annotations

import json
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
from compressed_tensors.quantization.utils import (
    calculate_qparams,
    is_module_quantized,
    maybe_pad_tensor_for_block_quant,
)
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
    weights = QuantizationArgs(
        num_bits=num_bits,
        type="int",
        symmetric=symmetric,
        strategy="group" if group_size else "channel",
        group_size=group_size,
        dynamic=False,
        actorder=None,
    )
    compressed_checkpoint(path, out_dir, "pack-quantized", weights)


def compressed_checkpoint(
    path: str | Path,
    out_dir: str | Path,
    quantization_format: str,
    weights: QuantizationArgs,
    input_activations: QuantizationArgs | None = None,
) -> None:
    """Write to `out_dir` the checkpoint at `path` with every language-model Linear quantized by
    `weights` (min/max qparams, as llm-compressor's default observer) and, with
    `input_activations`, its input quantized so: dynamic, or static at the scale a calibration pass
    observes (min/max over a few prompts' inputs); saved as the library saves it in
    `quantization_format`. The tokenizer, processor and chat template files are copied."""
    from transformers import AutoModelForImageTextToText

    path, out_dir = Path(path), Path(out_dir)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype="auto")
    observed = (
        _observe_inputs(model) if input_activations is not None and not input_activations.dynamic else {}
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=input_activations)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=IGNORE)
    apply_quantization_config(model, config, show_progress=False)
    for name, module in model.named_modules():
        if not is_module_quantized(module):
            continue
        low, high = _weight_range(module.weight.detach(), weights)
        scale, zero_point = calculate_qparams(low, high, weights)
        update_offload_parameter(module, "weight_scale", scale)
        if hasattr(module, "weight_zero_point"):
            update_offload_parameter(module, "weight_zero_point", zero_point)
        if name in observed:
            scale, zero_point = calculate_qparams(*observed[name], input_activations)
            update_offload_parameter(module, "input_scale", scale)
            if hasattr(module, "input_zero_point"):
                update_offload_parameter(module, "input_zero_point", zero_point)
        module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=quantization_format)
    compressor.compress_model(model)
    shutil.copytree(path, out_dir, ignore=shutil.ignore_patterns(*_WEIGHT_FILES), dirs_exist_ok=True)
    model.save_pretrained(out_dir)
    compressor.update_config(str(out_dir))


def _weight_range(weight: torch.Tensor, args: QuantizationArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """The min and max of each of `weight`'s quantization groups, shaped as the scales are."""
    if args.strategy == "group":
        grouped = weight.unflatten(-1, (-1, args.group_size))  # (rows, groups, group_size)
        return grouped.amin(-1), grouped.amax(-1)
    if args.strategy == "block":
        rows, cols = args.block_structure
        weight = maybe_pad_tensor_for_block_quant(weight, (rows, cols))  # zeros: the range keeps 0 anyway
        blocks = weight.unflatten(0, (-1, rows)).unflatten(-1, (-1, cols))  # (R, rows, C, cols)
        return blocks.amin((1, 3)), blocks.amax((1, 3))
    if args.strategy == "channel":
        return weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
    return weight.amin(), weight.amax()  # tensor


def _observe_inputs(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The min and max input of each language-model Linear over a calibration pass (a few random
    token sequences), before any quantization is applied."""
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def observe(name):
        def hook(_module, args):
            x = args[0].detach()
            low, high = seen.get(name, (x.amin(), x.amax()))
            seen[name] = (torch.minimum(low, x.amin()), torch.maximum(high, x.amax()))

        return hook

    language = model.model.language_model
    hooks = [
        m.register_forward_pre_hook(observe(f"model.language_model.{n}"))
        for n, m in language.named_modules()
        if isinstance(m, torch.nn.Linear)
    ]
    with torch.no_grad():
        vocab = model.config.get_text_config().vocab_size
        language(input_ids=torch.randint(4, vocab, (2, 16), generator=torch.Generator().manual_seed(0)))
    for hook in hooks:
        hook.remove()
    return seen


class _Dequantizer(CompressedTensorsDequantizer):
    """The library's dequantizer, its zero points handed over column-major: its 4-bit unpack
    (`unpack_from_int32(..., packed_dim=0)`) views the transposed tensor as bytes, which fails when
    the zero points pack into one row (8 or fewer output rows, e.g. Qwen3.5's tiny in_proj_a/b).
    Static input scales are dropped: the twin holds weights (input_quantized_reference reads them
    from the compressed checkpoint)."""

    def process(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tensors = {k: v for k, v in tensors.items() if not k.endswith((".input_scale", ".input_zero_point"))}
        for name, zero_point in tensors.items():
            if name.endswith(".weight_zero_point") and zero_point.ndim == 2:
                column_major = zero_point.new_empty_strided(zero_point.shape, (1, zero_point.shape[0]))
                tensors[name] = column_major.copy_(zero_point)
        return super().process(tensors)


def dequantized_twin(out_dir: str | Path, twin_dir: str | Path) -> None:
    """Write to `twin_dir` a float32 copy of the compressed checkpoint `out_dir` whose quantized
    weights are the library's own decompressed ones (its checkpoint dequantizer) and whose
    config.json has no `quantization_config`: an ordinary transformers checkpoint."""
    # `weight` is every module's parameter: in the unpacked formats (float-/int-quantized) the
    # library takes each one for a quantized weight unless its module is ignored
    dequantizer = _Dequantizer(
        out_dir, dtype=torch.float32, ignore=[*IGNORE, "re:.*embed_tokens$", "re:.*norm$"]
    )
    convert_checkpoint(out_dir, twin_dir, dequantizer, max_workers=1, device="cpu")
    for file in Path(twin_dir).glob("*.safetensors"):
        tensors = load_file(file)
        floats = {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}
        save_file(floats, file, metadata={"format": "pt"})


def input_quantized_reference(compressed_dir: str | Path, twin_dir: str | Path):
    """transformers running a W8A8 checkpoint the way compressed-tensors runs it: the dequantized
    twin's weights (the stored values) and the library's own forward on each quantized Linear
    (apply_quantization_config with the checkpoint's config, status `compressed`: the input is
    fake-quantized, the weight left as it is), static input scales read from the checkpoint.
    (transformers cannot run the checkpoint itself on CPU: its fp8/int8 weights reach F.linear.)"""
    from helpers.reference import FamilyReference

    ref = FamilyReference(str(twin_dir))
    quant = json.loads((Path(compressed_dir) / "config.json").read_text())["quantization_config"]
    groups = {name: QuantizationScheme.model_validate(g) for name, g in quant["config_groups"].items()}
    config = QuantizationConfig(config_groups=groups, ignore=IGNORE, quantization_status="compressed")
    apply_quantization_config(ref.model, config, show_progress=False)
    stored = load_file(Path(compressed_dir) / "model.safetensors")
    for name, module in ref.model.named_modules():
        if hasattr(
            module, "input_scale"
        ):  # the key as saved: `model.layers.0...` for `...language_model.layers.0...`
            tail = "." + name.split("language_model.")[-1] + ".input_scale"
            (key,) = [k for k in stored if k.endswith(tail)]
            update_offload_parameter(module, "input_scale", stored[key].float())
    return ref
