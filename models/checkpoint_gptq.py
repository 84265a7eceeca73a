"""GPTQ and AWQ checkpoints (`quant_method: gptq` / `awq`): int4 (GPTQ: also int8) weights packed
in int32 words, a float16 scale and a packed zero point per group of inputs and output column.

GPTQ (AutoGPTQ / GPTQModel, format `gptq` or `gptq_v2`): `qweight` `[K x bits / 32, N]` packed
along K (value i of a word at bit i x bits), `qzeros` `[groups, N x bits / 32]` packed along N,
`scales` `[groups, N]`, `g_idx` `[K]` (the group of each input):
w[n, k] = (q[k, n] - zero[g_idx[k], n]) x scale[g_idx[k], n], where format `gptq` (v1) stores
each zero point minus one. With act-order (`desc_act`) g_idx is not sorted: the inputs are
reordered so that each group's are contiguous, and the weight keeps that order (`perm`).
8-bit weights load as int8 when symmetric (every zero point 128).

AWQ (AutoAWQ's `gemm` version): `qweight` `[K, N / 8]` and `qzeros` `[K / group, N / 8]` packed
along N, a word's eight nibbles holding output columns 0, 2, 4, 6, 1, 3, 5, 7 of its eight;
`scales` `[K / group, N]`: w[n, k] = (q - zero) x scale.

What this does not read (2- and 3-bit GPTQ, asymmetric 8-bit, the Marlin and other kernel-specific
formats, AWQ's gemv and exllama versions) is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mm_engine.models.checkpoint_stored import load, split, unpack
from mm_engine.models.layers.quant_linear import QuantizedWeight

QWEIGHT = ".qweight"
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column (of 8) in each nibble of a word
_AWQ_NATURAL = [AWQ_ORDER.index(c) for c in range(8)]  # the nibble of each column


@dataclass(frozen=True, slots=True)
class Gptq:
    bits: int
    zero_offset: int  # 1 for format `gptq` (v1: the stored zero points are one less), else 0

    def split(self, state: dict) -> tuple[dict, dict[str, QuantizedWeight]]:
        return split(state, QWEIGHT, self._read)

    def _read(self, out: dict, module: str) -> QuantizedWeight:
        q = unpack(load(out.pop(f"{module}{QWEIGHT}")), self.bits, 0)  # [K, N]
        k, n = q.shape
        scales = load(out.pop(f"{module}.scales")).float()  # [groups, N]
        zeros = unpack(load(out.pop(f"{module}.qzeros")), self.bits, 1)[:, :n] + self.zero_offset
        groups = scales.shape[0]
        if k % groups:
            raise ValueError(f"{module}: {groups} GPTQ groups do not divide its {k} inputs")
        group, perm = k // groups, None
        g_idx = out.pop(f"{module}.g_idx", None)
        if g_idx is not None:
            g_idx = load(g_idx).long()
            order = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[order], torch.arange(k) // group):
                raise ValueError(f"{module}: g_idx does not give each of its {groups} groups {group} inputs")
            if not torch.equal(order, torch.arange(k)):  # act-order: the groups made contiguous
                q, perm = q[order], order
        q, scales, zeros = q.T.contiguous(), scales.T.contiguous(), zeros.T.float().contiguous()
        if self.bits == 4:
            zeros = None if bool((zeros == 8).all()) else zeros
            return QuantizedWeight("int4", q.to(torch.uint8), scales, zeros, group, perm)
        if bool((zeros == 128).all()):
            return QuantizedWeight("int8", (q - 128).to(torch.int8), scales, None, group, perm)
        raise ValueError(
            f"{module}: asymmetric 8-bit GPTQ weights (zero points other than 128) are not loaded"
        )


@dataclass(frozen=True, slots=True)
class Awq:
    def split(self, state: dict) -> tuple[dict, dict[str, QuantizedWeight]]:
        return split(state, QWEIGHT, self._read)

    def _read(self, out: dict, module: str) -> QuantizedWeight:
        q = _awq_unpack(load(out.pop(f"{module}{QWEIGHT}")))  # [K, N]
        zeros = _awq_unpack(load(out.pop(f"{module}.qzeros")))  # [groups, N]
        scales = load(out.pop(f"{module}.scales")).float()
        k, groups = q.shape[0], scales.shape[0]
        if k % groups:
            raise ValueError(f"{module}: {groups} AWQ groups do not divide its {k} inputs")
        weight = q.T.to(torch.uint8).contiguous()
        return QuantizedWeight(
            "int4", weight, scales.T.contiguous(), zeros.T.float().contiguous(), k // groups
        )


def _awq_unpack(words: torch.Tensor) -> torch.Tensor:
    nibbles = unpack(words, 4, 1)  # [rows, N]: column 8c + i holds output 8c + AWQ_ORDER[i]
    return nibbles.view(nibbles.shape[0], -1, 8)[..., _AWQ_NATURAL].flatten(1)


def gptq_format(quant: dict) -> Gptq:
    bits = quant.get("bits")
    fmt = str(quant.get("checkpoint_format") or quant.get("format") or "gptq").lower()
    if bits not in (4, 8):
        raise ValueError(f"GPTQ bits={bits!r} is not loaded (4 and 8 are)")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ format {fmt!r} is not loaded ('gptq' and 'gptq_v2' are)")
    return Gptq(bits, 1 if fmt == "gptq" else 0)


def awq_format(quant: dict) -> Awq:
    loaded = {"version": "gemm", "bits": 4, "zero_point": True}
    stored = {
        "version": str(quant.get("version") or quant.get("format") or "gemm").lower(),
        "bits": quant.get("bits", 4),
        "zero_point": quant.get("zero_point", True),
    }
    for option, value in stored.items():
        if value != loaded[option]:
            raise ValueError(f"AWQ {option}={value!r} is not loaded (4-bit 'gemm' with zero points is)")
    return Awq()
