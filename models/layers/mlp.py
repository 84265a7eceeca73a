"""The gated feed-forward block of the decoder (and of a mixture of experts' shared expert, and of
the Qwen2.5-VL and Pixtral towers), the plain one of the other towers, and the fusing of linears
that read the same input into one matmul."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from mm_engine.kernels.ops import TORCH_OPS, TorchOps
from mm_engine.models.layers.quant_linear import concat_weights, fusable
from mm_engine.parallel.group import TPGroup

# glibc serves a block of MMAP_BYTES or more (its largest mmap threshold) with a fresh mmap and
# gives it back on free, so an MLP over a tower's many patches faulted in every page of its hidden
# activations on every layer. Rows in even chunks of about CHUNK_BYTES of that temporary are served
# again from the heap. Chunks below MIN_CHUNK_ROWS are not worth it: each reads the weights again.
MMAP_BYTES = 32 * 1024**2
CHUNK_BYTES = 16 * 1024**2
MIN_CHUNK_ROWS = 256


def by_row_chunks(fn, x: torch.Tensor, width: int) -> torch.Tensor:
    """`fn(x)` for a row-wise `fn` whose widest temporary is `width` columns of x's dtype: on CPU
    in row chunks where that temporary would be mmap-sized whole."""
    whole = x.shape[0] * width * x.element_size()
    if x.device.type != "cpu" or x.dim() != 2 or whole < MMAP_BYTES:
        return fn(x)
    chunks = -(-whole // CHUNK_BYTES)
    rows = -(-x.shape[0] // chunks)
    if rows < MIN_CHUNK_ROWS:
        return fn(x)
    return torch.cat([fn(part) for part in x.split(rows)])


class MLP(nn.Module):
    """Gated MLP (`down(act(gate(x)) * up(x))`), `width` wide (default the config's
    intermediate_size). With `tp`, gate and up split by columns, down by rows, and the ranks'
    outputs summed, unless `reduce` is False (the caller sums them with other partial sums)."""

    def __init__(
        self,
        config,
        bias: bool,
        ops: TorchOps = TORCH_OPS,
        tp: TPGroup | None = None,
        dtype: torch.dtype = torch.float32,
        width: int | None = None,
        reduce: bool = True,
    ) -> None:
        super().__init__()
        width = (width or config.intermediate_size) // (tp.world if tp is not None else 1)
        self.tp = tp if reduce else None
        self.width = width
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=bias, dtype=dtype)
        self.up_proj = nn.Linear(config.hidden_size, width, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=bias, dtype=dtype)
        self.act = ACT2FN[config.hidden_act]
        self.silu = config.hidden_act == "silu"  # then silu(gate) * up is one op of `ops`
        self.gate_up_proj: nn.Linear | None = None
        self.ops = ops

    def fuse(self) -> None:
        if not can_concat([self.gate_proj, self.up_proj]):
            return  # e.g. GPTQ act-order with an input order of each: two matmuls
        self.gate_up_proj = concat_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = by_row_chunks(self._partial, x, 2 * self.width)
        return out if self.tp is None else self.tp.all_reduce(out)

    def _partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's output, before any all-reduce."""
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
            if self.silu:
                return self.down_proj(self.ops.silu_and_mul(gate_up))
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


class FeedForward(nn.Module):
    """fc1 -> act -> fc2, as Qwen2-VL, CLIP/SigLIP/InternViT (`fc1`, `fc2`) and Qwen3-VL / Qwen3.5
    (`linear_fc1`, `linear_fc2`) name them; tanh-GELU through the ops (in place on the hidden
    activations); on CPU in row chunks (`by_row_chunks`)."""

    def __init__(self, dim: int, hidden: int, act: str, names: tuple[str, str], ops: TorchOps) -> None:
        super().__init__()
        self.names = names
        self.hidden = hidden
        setattr(self, names[0], nn.Linear(dim, hidden))
        setattr(self, names[1], nn.Linear(hidden, dim))
        self.act = ops.gelu_tanh if act == "gelu_pytorch_tanh" else ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = (getattr(self, n) for n in self.names)
        return by_row_chunks(lambda rows: second(self.act(first(rows))), x, self.hidden)


def can_concat(parts: list[nn.Linear]) -> bool:
    """Whether `concat_linears` takes these: plain weights, or stored ones that one matmul can
    compute (models/layers/quant_linear.py `fusable`)."""
    stored = [getattr(p, "prequantized", None) for p in parts]
    return all(q is None for q in stored) or (all(q is not None for q in stored) and fusable(stored))


def concat_linears(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the parts' outputs side by side (a missing bias is zero)."""
    w = parts[0].weight
    fused = nn.Linear(
        w.shape[1], sum(p.out_features for p in parts), bias=any(p.bias is not None for p in parts),
        device=w.device, dtype=w.dtype,
    ).requires_grad_(False)  # fmt: skip
    stored = [getattr(p, "prequantized", None) for p in parts]  # a checkpoint's low-bit weights
    if any(q is not None for q in stored):
        if any(q is None for q in stored):
            raise ValueError("projections stored in different formats cannot be fused")
        fused.prequantized = concat_weights(stored)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if fused.bias is not None:
            fused.bias.copy_(
                torch.cat([p.bias if p.bias is not None else w.new_zeros(p.out_features) for p in parts])
            )
    return fused
