"""What the platform fills in for a model: the attention backend, the ops its layers call, how its
linear layers are packed.

On CPU with the "cpu" backend that is one ISA variant's C kernels (kernels/cpu_kernels.py: the
widest variant cpuid allows, each kernel only where it measured faster than its torch twin);
everywhere else torch. `Platform.info()` says which, for the start-up log line, /health,
/metrics and `mm-engine env`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from mm_engine.config import EngineConfig
from mm_engine.kernels import cpu_build, cpu_kernels, cpu_qgemm_a8
from mm_engine.kernels.backend import AttentionBackend, get_backend, resolve_backend_name
from mm_engine.kernels.cpu_kernels import CpuKernels
from mm_engine.kernels.ops import TorchOps, ops_for
from mm_engine.models.layers.packed_linear import pack_linears, panel_linears
from mm_engine.models.layers.quant_linear import INT8_INPUTS, quantize_linears

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Platform:
    device: torch.device
    backend: AttentionBackend
    ops: TorchOps
    kernels: CpuKernels | None  # the CPU C kernels in use; None: torch everywhere
    quantization: str | None = None  # the language model's linears rounded on load to this
    quantize_lm_head: bool = False  # ... its head included

    def info(self) -> dict:
        kernels = self.kernels
        return {
            "device": self.device.type,
            "attention_backend": self.backend.name,
            "cpu_variant": kernels.variant if kernels else None,
            "cpu_kernels": sorted(kernels.enabled) if kernels else [],
            "quantization": self.quantization,
            "quantized_lm_head": self.quantization is not None and self.quantize_lm_head,
            "quantized_compute": self.quantized_compute(),
        }

    def quantized_compute(self) -> str | None:
        """How `quantization` computes here (None: none asked for)."""
        return None if self.quantization is None else self.low_bit_path()

    def low_bit_path(self) -> str:
        """How low-bit linears compute: the Triton kernel, the CPU's low-bit GEMM, or the
        dequantizing reference."""
        if self.backend.name == "triton":
            return "triton"
        lib = self.qgemm_lib()
        if lib is None:
            return "dequantize"
        kind = INT8_INPUTS.get(self.quantization or "")
        integer = kind is not None and cpu_qgemm_a8.available(lib, kind)
        return f"qgemm-{self.kernels.variant}" + ("-int8-inputs" if integer else "")

    def qgemm_lib(self):
        return self.kernels.lib if self.kernels is not None and self.kernels.uses("qgemm") else None

    def summary(self) -> str:
        info = self.info()
        quant = (
            f", quantization={info['quantization']} ({info['quantized_compute']})"
            if self.quantization
            else ""
        )
        if info["cpu_variant"] is None:
            return (
                f"device={info['device']}, attention={info['attention_backend']}, CPU C kernels: none{quant}"
            )
        kernels = ",".join(info["cpu_kernels"])
        return f"device=cpu, attention=cpu, CPU C kernels: variant={info['cpu_variant']} ({kernels}){quant}"


def make_platform(
    device: torch.device,
    attention_backend: str,
    cpu_variant: str | None = None,
    cpu_kernel_set: str | None = None,
    quantization: str | None = None,
    quantize_lm_head: bool = False,
) -> Platform:
    """`cpu_variant` and `cpu_kernel_set`: the engine's `cpu_kernel_variant` and `cpu_kernels`
    (None: `$MM_ENGINE_CPU_VARIANT` / `$MM_ENGINE_CPU_KERNELS`, else the CPU's widest variant
    and the measured table)."""
    kernels = None
    if device.type == "cpu" and resolve_backend_name(attention_backend, device) == "cpu":
        kernels = cpu_kernels.select(cpu_variant, cpu_kernel_set)
        if kernels is None and cpu_build.status()["errors"]:
            log.warning("no CPU C kernels: %s", cpu_build.status()["errors"])
    backend = get_backend(attention_backend, device, kernels)
    platform = Platform(
        device, backend, ops_for(kernels, backend.name), kernels, quantization, quantize_lm_head
    )
    log.info("platform: %s", platform.summary())
    return platform


def platform_for(config: EngineConfig, device: torch.device) -> Platform:
    """The platform an engine's `EngineConfig` asks for on `device`."""
    return make_platform(
        device, config.attention_backend, config.cpu_kernel_variant, config.cpu_kernels,
        config.quantization, config.quantize_lm_head,
    )  # fmt: skip


def environment() -> dict:
    """The platform as `mm-engine env` prints it: machine, torch, the CPU's features and the
    kernel variants it runs, the compiler, the OpenMP runtime, and what the engine would use."""
    import platform as host

    from mm_engine.kernels.cpu_kernels import MEASURED_FASTER

    kernels = cpu_kernels.select()
    cpu = cpu_build.status()
    model = next(
        (line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")),
        host.processor(),
    )
    return {
        "platform": host.platform(),
        "python": host.python_version(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "cpu": model,
        "cpu_features": cpu["features"],
        "compiler": cpu["compiler"],
        "openmp_runtime": cpu["openmp_runtime"],
        "variants_supported": [v for v in cpu_build.VARIANTS if cpu_build.supported(v)],
        "variant": kernels.variant if kernels else None,
        "kernels": sorted(kernels.enabled) if kernels else [],
        "measured_faster": {v: sorted(k) for v, k in MEASURED_FASTER.items()},
        # What `quantization` (bf16, fp8, int8, int4) would compute with here.
        "quantized_compute": f"qgemm-{kernels.variant}"
        if kernels and kernels.uses("qgemm")
        else "dequantize",
        "errors": cpu["errors"],
    }


def _cpuinfo() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:  # the model's name only: features come from cpuid
            return f.read().splitlines()
    except OSError:
        return []


def quantize_model_linears(language_model: nn.Module, platform: Platform) -> None:
    """The language model's linears (its head only if asked) rounded to the platform's
    quantization, and those a checkpoint stores quantized kept as stored."""
    tp = getattr(language_model, "tp", None)
    world = tp.world if tp is not None else 1
    skip = () if platform.quantize_lm_head else ("lm_head",)
    triton = platform.backend.name == "triton"
    count = quantize_linears(language_model, platform.quantization, platform.qgemm_lib(), world, skip, triton)
    if count:
        kind = platform.quantization or "as stored"
        log.info("quantized linear layers: %d (%s, %s)", count, kind, platform.low_bit_path())


def pack_model_linears(model: nn.Module, language_model: nn.Module, platform: Platform) -> None:
    """The language model's linears through the C GEMM where the platform uses it (faster at
    decode's few rows); every other CPU linear through oneDNN with a packed weight."""
    if platform.kernels is not None and platform.kernels.uses("gemm"):
        panel_linears(language_model, platform.kernels.lib)
    pack_linears(model)
