"""Linear layers with low-bit weights: the language model's projections quantized on load
(`quantization`: bf16, fp8, int8 or int4, weight-only; w8a8 and w4a8, the input rounded to int8
per token as well), computed without a float32 copy of the weight on CPU.

A weight is stored as `q` `[N, K]` with a float32 scale per output row and group of `group`
columns of K (and for int4 a zero point): w = (q - zero) * scale. int8 and int4 are symmetric
(zero 0, and 8 for int4's unsigned 0..15), scaled to each group's largest magnitude; fp8 is e4m3
scaled so that each group's largest magnitude is 448; bf16 keeps no scale. Groups are 128 columns
where K allows (64, 32, else the whole row), so a tensor-parallel shard of K along group
boundaries quantizes exactly as the whole.

On CPU with the `qgemm` kernel, `QuantLinear` packs the weight once into the kernel's panels
(kernels/cpu_qgemm.py) and keeps nothing else; on the triton backend it runs the Triton kernel on
`q` as kept (kernels/triton_qgemm.py), or `torch._scaled_mm` where input and weight are both FP8
with a scale per weight row (kernels/fp8_mm.py); elsewhere it multiplies by the dequantized weight (the
reference: every call rebuilds the float matrix).

Checkpoints stored quantized (models/checkpoint_quant.py) may add two things to a weight: an input
column order (GPTQ's act-order), which the kernels' paths gather the input by, and an input
quantization (compressed-tensors' W8A8), applied to the input rows before any path. With int8
inputs, where the CPU takes the weight kind (AVX-512 VNNI: int8 and int4; AVX2: int4), the
integer kernel (kernels/cpu_qgemm_a8.py) rounds the input itself and multiplies in integers.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from mm_engine.config import QUANTIZATIONS
from mm_engine.kernels import cpu_gemm, cpu_qgemm, cpu_qgemm_a8, fp8_mm
from mm_engine.models.layers import act_quant
from mm_engine.parallel.shard import ROW

GROUPS = (128, 64, 32)
INT8_INPUTS = {"w8a8": "int8", "w4a8": "int4"}  # quantization -> weight kind, inputs int8 per token
_RANGE = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}


@dataclass(slots=True)
class QuantizedWeight:
    kind: str
    q: torch.Tensor  # [N, K]: bfloat16, float8_e4m3fn, int8, or uint8 (int4 values 0..15)
    scales: torch.Tensor | None  # float32 [N, K / group]; None for bf16
    zeros: torch.Tensor | None  # float32 [N, K / group]; None: the kind's own (8 for int4, else 0)
    group: int
    # The input columns in the order `q` stores them (GPTQ's act-order: its groups are contiguous
    # only so); the layer gathers its input so. None: the natural order.
    perm: torch.Tensor | None = None
    # The input's quantization (act_quant.py): None, or "int8"/"fp8" per token, or per tensor at
    # the stored `act_scale`.
    act: str | None = None
    act_scale: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 `[N, K]`, its columns in the input's order."""
        values = self.q.float()
        if self.scales is not None:
            n, k = values.shape
            values = values.view(n, k // self.group, self.group)
            zero = self.zeros[..., None] if self.zeros is not None else 8.0 if self.kind == "int4" else 0.0
            values = ((values - zero) * self.scales[..., None]).view(n, k)
        if self.perm is None:
            return values
        return torch.empty_like(values).index_copy_(1, self.perm, values)

    def rows(self, start: int, end: int) -> QuantizedWeight:
        """Output rows [start, end) (a column-parallel shard)."""
        return replace(self, q=self.q[start:end], scales=_cut_rows(self.scales, start, end),
                       zeros=_cut_rows(self.zeros, start, end))  # fmt: skip

    def columns(self, start: int, end: int) -> QuantizedWeight:
        """Input columns [start, end) (a row-parallel shard), each with its group's scale and zero
        point: the part's groups are gcd(width, group) wide, so none straddles two of the whole's."""
        if self.perm is not None:
            raise ValueError("its inputs are stored in act-order (GPTQ desc_act): a group gathers inputs "
                             "from the whole row, so a range of inputs has no groups of its own")  # fmt: skip
        width = end - start
        group = width if self.scales is None else math.gcd(width, self.group)
        if self.scales is not None and (start % group or (self.kind == "int4" and group % 2)):
            raise ValueError(f"inputs {start}..{end} do not fit its groups of {self.group}")
        which = torch.arange(start, end, group) // self.group  # the whole's group of each part group
        scales = None if self.scales is None else self.scales[:, which].contiguous()
        zeros = None if self.zeros is None else self.zeros[:, which].contiguous()
        return replace(self, q=self.q[:, start:end].contiguous(), scales=scales, zeros=zeros, group=group)

    def padded_rows(self, n: int) -> QuantizedWeight:
        """`n` rows, the added ones zero (values and scales 0): a vocabulary's even share."""
        extra = n - self.q.shape[0]
        pad = [None if t is None else torch.cat([t, t.new_zeros(extra, t.shape[1])])
               for t in (self.q, self.scales, self.zeros)]  # fmt: skip
        return replace(self, q=pad[0], scales=pad[1], zeros=pad[2])

    def to(self, device: torch.device) -> QuantizedWeight:
        moved = (None if t is None else t.to(device) for t in (self.q, self.scales, self.zeros))
        perm, act_scale = (None if t is None else t.to(device) for t in (self.perm, self.act_scale))
        return QuantizedWeight(self.kind, *moved, self.group, perm, self.act, act_scale)


def _cut_rows(t: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    return None if t is None else t[start:end]


def concat_weights(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Weights of one kind and group stacked by rows (fused projections)."""
    if not fusable(parts):
        raise ValueError(
            "projections stored in different formats, input orders (act-order) or input "
            "quantizations cannot be fused"
        )
    first = parts[0]
    scales = None if first.scales is None else torch.cat([p.scales for p in parts])
    zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts])
    q = torch.cat([p.q for p in parts])
    return QuantizedWeight(first.kind, q, scales, zeros, first.group, first.perm, first.act, first.act_scale)


def fusable(parts: list[QuantizedWeight]) -> bool:
    """Whether the weights can be one matmul: one format, and one input (same order, same
    quantization)."""
    first = parts[0]
    return all(
        p.kind == first.kind
        and p.group == first.group
        and (p.zeros is None) == (first.zeros is None)
        and p.act == first.act
        and _same(p.perm, first.perm)
        and _same(p.act_scale, first.act_scale)
        for p in parts
    )


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is b or (a is not None and b is not None and torch.equal(a, b))


def group_size(k: int) -> int:
    return next((g for g in GROUPS if k % g == 0), k)


def quantize(weight: torch.Tensor, kind: str, group: int | None = None) -> QuantizedWeight:
    """Round a float weight `[N, K]` to `kind`, one scale per row and `group` columns (None:
    `group_size(K)`; see the module docstring). w8a8 and w4a8: int8 and int4 weights whose layer
    rounds its input to int8 per token too."""
    if kind not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {kind!r}")
    if kind in INT8_INPUTS:
        rounded = quantize(weight, INT8_INPUTS[kind], group)
        rounded.act = "int8"
        return rounded
    w = weight.detach().float()
    n, k = w.shape
    if kind == "bf16":
        return QuantizedWeight(kind, w.to(torch.bfloat16), None, None, k)
    group = group or group_size(k)
    if kind == "int4" and group % 2:
        raise ValueError(f"int4 needs an even number of input features, got {k}")
    blocks = w.view(n, k // group, group)
    scales = blocks.abs().amax(-1) / _RANGE[kind]
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero group stays zero
    scaled = blocks / scales[..., None]
    if kind == "fp8":
        q = scaled.to(torch.float8_e4m3fn)
    elif kind == "int8":
        q = scaled.round().clamp(-127, 127).to(torch.int8)
    else:
        q = (scaled.round().clamp(-8, 7) + 8).to(torch.uint8)
    return QuantizedWeight(kind, q.view(n, k), scales, None, group)


class QuantLinear(nn.Module):
    """`nn.Linear` for inference with a low-bit weight (module docstring). `lib`: the CPU kernels'
    library when its `qgemm` runs here; None: the dequantizing reference."""

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: torch.Tensor | None,
        lib: ctypes.CDLL | None = None,
        triton: bool = False,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.q.shape
        self.kind, self.lib, self.triton = weight.kind, lib, triton
        self.weight_q: QuantizedWeight | None = None
        self.panels: cpu_qgemm.QPanels | None = None
        self.a8: cpu_qgemm_a8.A8Panels | None = None
        self.a8_scale: torch.Tensor | None = None
        self.bias = None if bias is None else bias.detach()
        self.perm, self.act, self.act_scale = weight.perm, weight.act, weight.act_scale
        # FP8 on both sides (compressed-tensors' FP8 schemes): the matrix units' own FP8 product.
        self.fp8 = (
            triton
            and fp8_mm.applies(weight.kind, weight.act, weight.group, *weight.q.shape)
            and fp8_mm.device_supports(weight.q.device)
        )
        if lib is not None and not cpu_qgemm.fits(weight.kind, weight.q.shape[1], weight.group):
            lib = None  # no checkpoint we know has such a shape: the dequantizing path, correct and slow
        if lib is None:
            self.weight_q = weight
            if triton and weight.kind == "int4":  # two to a byte, as the Triton kernel reads them
                self.packed_int4 = cpu_qgemm.int4_bytes(weight.q)
            return
        width = cpu_gemm.panel_width(lib)
        stored = weight.kind, weight.q, weight.scales, weight.zeros, weight.group, width
        kind, k, group = weight.kind, weight.q.shape[1], weight.group
        if weight.act == "int8" and cpu_qgemm_a8.available(lib, kind) and cpu_qgemm_a8.fits(kind, k, group):
            self.a8 = cpu_qgemm_a8.pack(*stored)  # int8 inputs: integer dot products
            # a static input scale as the kernel reads it (None: one per row, from the row)
            self.a8_scale = None if self.act_scale is None else self.act_scale.float().reshape(1).contiguous()
        else:
            self.panels = cpu_qgemm.pack(*stored)
        self.bias = cpu_gemm.padded_bias(self.bias, width)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, kind: str, lib: ctypes.CDLL | None = None, group: int | None = None,
        triton: bool = False,
    ) -> QuantLinear:  # fmt: skip
        return cls(quantize(linear.weight, kind, group), linear.bias, lib, triton)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.a8 is not None:  # rounds its input itself, as fake_quantize would
            out = cpu_qgemm_a8.qgemm_a8(self.lib, self._rows(x), self.a8, self.a8_scale, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        if self.fp8 and fp8_mm.takes(x):  # rounds its input itself, as fake_quantize would
            w = self.weight_q
            out = fp8_mm.fp8_linear(self._rows(x), w.q, w.scales, self.act_scale, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        if self.act is not None:
            x = act_quant.fake_quantize(x, self.act, self.act_scale)
        if self.panels is None and not self.triton:  # the dequantized weight is in the input's order
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self.weight_q.dequantize().to(x.dtype), bias)
        rows = self._rows(x)
        out = self._triton(rows) if self.triton else cpu_qgemm.qgemm(self.lib, rows, self.panels, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """The input as the kernels read it: `[M, K]` with unit column stride, in the stored order."""
        if not self.triton and (x.dtype != torch.float32 or x.device.type != "cpu"):
            raise TypeError(f"QuantLinear's CPU kernel takes float32 CPU input, got {x.dtype} on {x.device}")
        rows = x.reshape(-1, self.in_features)
        if self.perm is not None:  # the kernels read the columns as stored
            return rows.index_select(1, self.perm)
        return rows if rows.stride(-1) == 1 else rows.contiguous()

    def _triton(self, rows: torch.Tensor) -> torch.Tensor:
        from mm_engine.kernels import triton_qgemm

        w = self.weight_q
        q = self.packed_int4 if w.kind == "int4" else w.q
        bias = None if self.bias is None else self.bias.to(rows.dtype)
        return triton_qgemm.qgemm(rows, w.kind, q, w.scales, w.zeros, w.group, bias)

    def extra_repr(self) -> str:
        path = "cpu kernel" if self.panels is not None else "triton" if self.triton else "dequantize"
        path = "cpu int8-input kernel" if self.a8 is not None else "fp8 scaled_mm" if self.fp8 else path
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}, {path}"


def quantize_linears(
    module: nn.Module, kind: str | None, lib: ctypes.CDLL | None, world: int = 1,
    skip: tuple[str, ...] = ("lm_head",), triton: bool = False,
) -> int:  # fmt: skip
    """Replace every `nn.Linear` under `module` (but those named in `skip`) with a `QuantLinear`
    of `kind`, and every one that carries its checkpoint's stored weight (`prequantized`,
    models/checkpoint_quant.py) with a `QuantLinear` of that weight as stored, whatever `kind`
    (None: only those); returns how many. `world`: the tensor-parallel ranks the module is split
    over; a row-parallel layer's groups are then those of its whole input, so that every rank's
    shard rounds as the whole would (refused where they do not fit the shard). `triton`: the
    modules compute with the Triton kernel (the triton attention backend's platform)."""
    count = 0
    for name, child in list(module.named_children()):
        stored = getattr(child, "prequantized", None)
        if isinstance(child, nn.Linear) and stored is not None:
            setattr(module, name, QuantLinear(stored.to(child.weight.device), child.bias, lib, triton))
            count += 1
        elif name in skip:
            continue
        elif isinstance(child, nn.Linear):
            if kind is None:
                continue
            group = None
            if world > 1 and name in ROW and kind != "bf16":
                group = group_size(child.in_features * world)
                if child.in_features % group:
                    raise ValueError(
                        f"quantization groups of {group} inputs do not fit {name}'s shard of "
                        f"{child.in_features} under tensor_parallel_size {world}"
                    )
            setattr(module, name, QuantLinear.from_linear(child, kind, lib, group, triton))
            count += 1
        else:
            count += quantize_linears(child, kind, lib, world, skip, triton)
    return count
