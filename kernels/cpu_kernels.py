"""Which C kernels run here: one ISA variant's library, and the kernels used with it.

A kernel is used on a variant only where bench.kernels_cpu measured it faster than its torch or
oneDNN twin on that ISA (torch itself held to the same ISA); `MEASURED_FASTER` is that table,
and bench.kernels_cpu prints, next to each measurement, whether the table agrees.
`$MM_ENGINE_CPU_KERNELS` overrides it: `all`, `none`, or a comma-separated list of names.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

from mm_engine.kernels import cpu_build

KERNELS = (
    "gemm",  # the language model's linears (cpu_gemm.c) in place of oneDNN's packed sgemm
    "decode",  # paged decode attention (cpu_decode.c) in place of the gathered torch path
    "prefill",  # paged prefill attention (cpu_prefill.c) in place of SDPA over gathered K/V
    "vision_attention",  # a vision tower's attention over whole images (cpu_prefill.c) in place of SDPA
    "vision_windows",  # ... over windows of images (Qwen2.5-VL), all of a layer's in one call
    "kv_write",  # the K/V write (cpu_kv_write.c) in place of index_put_
    "rms_norm",  # RMSNorm with the residual add, and the gated one (cpu_elementwise.c), in place of torch
    "rotary",  # rotary embedding in place, in place of the torch halves
    "silu_and_mul",  # silu(gate) * up in one pass, in place of two ops
    "gelu_tanh",  # tanh-GELU in place, in place of F.gelu
    "delta_rule",  # Gated DeltaNet's decode step and conv, in place in the state pool (cpu_linear_attention)
    "qgemm",  # quantized linears (cpu_qgemm.c) in place of dequantize-then-matmul
    "layer_decode",  # a decoder layer's decode step in one call (cpu_layer_decode.c): the kernels above
)
# From bench.kernels_cpu on the 2-core AMD EPYC (Zen 4) development machine, which runs every
# variant (torch held to the same ISA in each; bench/results/kernels_cpu.json is the last of three
# runs). A kernel that did not win in every run stays off: on the portable variant the GEMM
# (geometric means 1.03x and 1.00x, 0.94x at one row) and prefill attention (0.98x and 0.85x on a
# chunk after cached context).
# The towers' attention over whole images (`vision_attention`, packed images through
# `varlen_attention`) on avx512, from a Zen 5 (2026-12-04, bench/results/kernels_cpu_zen5.json):
# 1.99x its torch twin on 8 images of 196 patches, and the whole tower 1.10-1.19x faster with it
# in three alternating runs of SigLIP at 224 px x 16, Idefics3 and InternViT at 448 px x 1 and x 4
# (0.84-1.06x at one 224 px image). On avx2 it is off until measured on an AVX2-only CPU in this
# form (an earlier form, over transformers' per-image layout, lost there 0.80-0.93x).
# Images of 2,048 patches or more (OCR pages) skip it (`ops.LONG_SEGMENT`): on the Zen 4 machine
# (2026-12-05, one image, 16 heads, against SDPA) it ran at 0.77x SDPA's speed at 3,000 patches
# of head 64, 0.55-0.65x at 6,000 to 11,088, and level (1.01-1.03x) at 8,580 to 11,088 of head 72:
# it reads K and V rows a whole token apart (4 KiB at 16 heads of 64).
# The windowed attention of Qwen2.5-VL's tower (16 to 256 windows of 64 patches, 12 heads of 64)
# against SDPA over the windows batched by length: 1.8-1.9x on avx512, 1.5-1.9x on avx2.
# The Gated DeltaNet decode step (`delta_rule`, bench/results/kernels_cpu_delta_rule.json) won
# everywhere it ran: on a Zen 3 (AVX2 only) 8.6x, 49x, 24x on avx2 and 5.3x, 28x, 17x on portable
# at 1, 8, 32 sequences of 16 heads of 128x128; on a Zen 4 10.2x, 51x, 23.5x on avx512.
# `layer_decode` runs the kernels above in one call per layer part instead of one Python call
# each (bench.layer_decode: the engine with and without it, side by side); it is on wherever the
# kernels it strings together are (a part whose kernels are off keeps its modules).
MEASURED_FASTER: dict[str, frozenset[str]] = {
    "avx512": frozenset(KERNELS),
    "avx2": frozenset(KERNELS) - {"vision_attention"},
    # qgemm on portable: 16-23x dequantize-then-matmul at 1 row, 7.5x at 8, but 0.79-0.90x at 256
    # rows (its scratch path runs the portable float GEMM, itself off here): off until that path
    # hands big batches to torch.
    "portable": frozenset(KERNELS) - {"vision_attention", "vision_windows", "gemm", "prefill", "qgemm"},
}


@dataclass(frozen=True, slots=True)
class CpuKernels:
    variant: str
    lib: ctypes.CDLL
    enabled: frozenset[str]

    def uses(self, kernel: str) -> bool:
        return kernel in self.enabled


def select(variant: str | None = None, kernels: str | None = None) -> CpuKernels | None:
    """The kernels for this process: `variant` (default `cpu_build.best_variant()`), with the
    kernels `kernels` names (default `$MM_ENGINE_CPU_KERNELS`, else the measured table); None
    where no library builds or none is enabled."""
    name = cpu_build.best_variant(variant)
    spec = kernels if kernels is not None else os.environ.get("MM_ENGINE_CPU_KERNELS", "measured")
    enabled = _parse(spec, name)
    if not enabled:
        return None
    lib = cpu_build.load(name)
    return None if lib is None else CpuKernels(name, lib, enabled)


def _parse(spec: str, variant: str) -> frozenset[str]:
    spec = spec.strip().lower()
    if spec == "measured":
        return MEASURED_FASTER.get(variant, frozenset())
    if spec == "all":
        return frozenset(KERNELS)
    if spec in ("none", ""):
        return frozenset()
    names = frozenset(n.strip() for n in spec.split(",") if n.strip())
    unknown = sorted(names - set(KERNELS))
    if unknown:
        raise ValueError(
            f"unknown CPU kernel(s) {unknown}; known: {', '.join(KERNELS)}, or all / none / measured"
        )
    return names
