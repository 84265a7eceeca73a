"""What the readers of checkpoints stored quantized (models/checkpoint_quant.py) share: the loop
that swaps each stored layer for its dequantized weight, and the unpacking of int32 words."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mm_engine.models.layers.quant_linear import QuantizedWeight


def split(
    state: dict, marker: str, read: Callable[[dict, str], QuantizedWeight]
) -> tuple[dict, dict[str, QuantizedWeight]]:
    """`state` with each stored-quantized layer (found by its `marker` key; `read(state, module)`
    pops its tensors) replaced by its dequantized float32 weight (`Dequantized`), so that the
    module loads as usual, and per module path (`layers.0.mlp.up_proj`) its weight as stored."""
    out, stored = dict(state), {}
    for key in [k for k in state if k.endswith(marker)]:
        module = key[: -len(marker)]
        stored[module] = read(out, module)
        out[f"{module}.weight"] = Dequantized(stored[module])
    return out, stored


class Dequantized:
    """A stored weight as the float32 weight it stands for, computed when read, like a checkpoint
    reference (models/weights.py `WeightRef`): whole, or only a tensor-parallel shard."""

    __slots__ = ("weight",)

    def __init__(self, weight: QuantizedWeight) -> None:
        self.weight = weight

    @property
    def shape(self) -> list[int]:
        return list(self.weight.q.shape)

    def load(self) -> torch.Tensor:
        return self.weight.dequantize()

    def load_range(self, dim: int, start: int, end: int) -> torch.Tensor:
        w = self.weight
        return (w.rows(start, end) if dim == 0 else w.columns(start, end)).dequantize()


def unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 `words` holding 32 / bits unsigned values each (value i at bit i x bits), unpacked
    along `dim` (0 or 1): value i of word (r, c) lands at row r x 32 / bits + i (dim 0) or column
    c x 32 / bits + i (dim 1). int64 values."""
    unsigned = words.to(torch.int64) & 0xFFFFFFFF
    values = [(unsigned >> (bits * i)) & ((1 << bits) - 1) for i in range(32 // bits)]
    return torch.stack(values, dim=dim + 1).flatten(dim, dim + 1)


def load(ref) -> torch.Tensor:
    """A checkpoint tensor, read now if it is a reference (models/weights.py `WeightRef`)."""
    return ref.load() if hasattr(ref, "load") else ref


def block_scales(module: str, scales: torch.Tensor, rows: int, cols: int, n: int, k: int):
    """Scales of `rows` x `cols` blocks of an `n` x `k` weight as the per-row form
    (`[N, K / group]`) and its group (the block width, or all of K when narrower)."""
    if k % cols and k > cols:
        raise ValueError(f"{module}: {k} input features are not whole {cols}-wide blocks")
    group = min(cols, k)
    per_row = scales.float().repeat_interleave(rows, dim=0)[:n]
    if per_row.shape != (n, -(-k // group)):
        raise ValueError(
            f"{module}: block scales of shape {tuple(scales.shape)} do not fit a {n} x {k} weight"
        )
    return per_row.contiguous(), group
