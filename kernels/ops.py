"""The ops a model's layers call, filled by the platform: `TorchOps` (the reference, any device
and dtype) or `CpuOps` (the C kernels of one ISA variant where they are enabled and apply, torch
for the rest). A layer holds one and calls it; nothing patches the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mm_engine.kernels import cpu_elementwise, cpu_linear_attention, cpu_prefill, gated_delta
from mm_engine.kernels.cpu_kernels import CpuKernels


class TorchOps:
    name = "torch"
    kernels: CpuKernels | None = None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # torch's fused kernel: one pass and no temporaries instead of the pow/mean/rsqrt/mul
        # spelling, with bit-identical float32 output. Half inputs are normalised in float32 and
        # cast back before the weight, as the Hugging Face models do.
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, eps)
        return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`x += delta` in place (x is the residual stream, owned by the forward pass), then
        `(x, rms_norm(x))`."""
        x.add_(delta)
        return x, self.rms_norm(x, weight, eps)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`[tokens, heads, head_dim]`, rotate_half layout: (x1, x2) -> (x1 cos - x2 sin, x2 cos +
        x1 sin), cos and sin `[tokens, 1, head_dim // 2]`. May rotate `x` in place (callers pass
        projection outputs nothing else reads); use the result. Written into halves of one output
        rather than as `x * cos + rotate_half(x) * sin`: the same arithmetic, no negated copy."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        torch.mul(x1, cos, out=out[..., :half]).sub_(x2 * sin)
        torch.mul(x2, cos, out=out[..., half:]).add_(x1 * sin)
        return out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """`[..., 2 * cols]` (gate, up side by side) -> `silu(gate) * up`."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh(self, x: torch.Tensor) -> torch.Tensor:
        """transformers' tanh-GELU; may overwrite `x` (an MLP's hidden activations)."""
        return F.gelu(x, approximate="tanh")

    def delta_rule_step_(
        self, state: torch.Tensor, slots: torch.Tensor, qkv: torch.Tensor, g: torch.Tensor,
        beta: torch.Tensor, key_heads: int,
    ) -> torch.Tensor:  # fmt: skip
        """The gated delta rule's decode step for a batch: `state` the pool `[rows, heads, key_dim,
        value_dim]` (float32), updated in place at rows `slots`; `qkv` `[batch, q | k | v]`; g and
        beta `[batch, heads]`. Returns `[batch, heads, value_dim]` in float32."""
        heads, dk, dv = state.shape[1:]
        n = qkv.shape[0]
        q, k, v = qkv.split([key_heads * dk, key_heads * dk, heads * dv], -1)
        shaped = q.reshape(n, key_heads, dk), k.reshape(n, key_heads, dk), v.reshape(n, heads, dv)
        out, new = gated_delta.delta_rule_step(*shaped, g, beta, state[slots])
        state.index_copy_(0, slots, new)
        return out

    def conv_step_(
        self, conv: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, weight: torch.Tensor
    ) -> torch.Tensor:
        """The causal depthwise conv + SiLU for one token of each of a batch: `conv` the pool
        `[rows, channels, width - 1]`, updated in place at rows `slots`; `x` `[batch, channels]`;
        `weight` `[channels, width]`. Returns `[batch, channels]`."""
        y, new = gated_delta.causal_conv_step(x, weight, conv[slots])
        conv.index_copy_(0, slots, new.to(conv.dtype).contiguous())  # contiguous: 10x the copy speed
        return y

    def gated_rms_norm(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float):
        """`rms_norm(x) * weight * silu(gate)` row by row (a linear-attention layer's output norm)."""
        return gated_delta.gated_rms_norm(x, gate, weight, eps)

    def gated_delta_decode_(
        self, conv: torch.Tensor, recurrent: torch.Tensor, slots: torch.Tensor, mixed: torch.Tensor,
        z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, w: gated_delta.DeltaWeights,
    ) -> torch.Tensor:  # fmt: skip
        """A linear-attention layer's decode for a batch of one-token sequences, after its input
        projection (`mixed` `[batch, channels]`, `z` `[batch, heads * value_dim]`, b and a `[batch,
        heads]`): the conv step, the gates, the delta rule step (both pools updated in place at
        rows `slots`) and the gated norm. Returns `[batch, heads * value_dim]` in z's dtype."""
        beta, g = gated_delta.gates(b, a, w.a_log, w.dt_bias)
        y = self.conv_step_(conv, slots, mixed, w.conv)
        out = self.delta_rule_step_(recurrent, slots, y, g, beta, w.key_heads)
        n, heads, dv = out.shape
        rows = out.to(z.dtype).view(n * heads, dv)
        return self.gated_rms_norm(rows, z.reshape(n * heads, dv), w.norm, w.eps).view(n, heads * dv)

    def delta_rule_chunked(self, q, k, v, g, beta, state):
        """One sequence's prefill piece: gated_delta.delta_rule_chunked's contract."""
        return gated_delta.delta_rule_chunked(q, k, v, g, beta, state)

    def moe_experts(
        self, x: torch.Tensor, token: torch.Tensor, expert: torch.Tensor, gate_up: torch.Tensor,
        down: torch.Tensor, act=None,
    ) -> torch.Tensor:  # fmt: skip
        """Each (token, expert) pair's expert output `[pairs, hidden]`, pairs sorted by `expert`
        (`token` `[pairs]` indexes x's rows). `gate_up` `[experts, hidden, 2 x width]` (gate, then
        up), `down` `[experts, width, hidden]`; `act` the gate's activation (None: SiLU). Grouped:
        each expert with pairs runs once over all of them."""
        counts = torch.bincount(expert, minlength=gate_up.shape[0]).tolist()
        rows = x[token]
        out = torch.empty(rows.shape[0], down.shape[-1], dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n:
                h = rows[start : start + n] @ gate_up[e]
                if act is None:
                    h = self.silu_and_mul(h)
                else:
                    gate, up = h.chunk(2, dim=-1)
                    h = act(gate) * up
                out[start : start + n] = h @ down[e]
                start += n
        return out

    def varlen_attention(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments, scale: float
    ) -> torch.Tensor:
        """A vision tower's attention over packed images: `[tokens, heads, dim]` each (views into
        one projection output are fine), every row sees every row of its segment (`segments`:
        `starts`, `lens` tiling the tokens); `[tokens, heads, dim]` out, contiguous. Segments of
        one length go to SDPA together, as one batch."""
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        by_len: dict[int, list[int]] = {}
        for start, n in zip(segments.starts, segments.lens, strict=True):
            by_len.setdefault(n, []).append(start)
        for n, starts in by_len.items():
            rows = (torch.tensor(starts)[:, None] + torch.arange(n)).to(query.device)  # [batch, n]
            q, k, v = (x[rows].transpose(1, 2) for x in (query, key, value))  # [batch, heads, n, dim]
            out[rows] = F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2)
        return out


LONG_SEGMENT = 2048  # rows of one image from which a tower's attention runs on SDPA


class CpuOps(TorchOps):
    """The C kernels of `kernels.variant` for what `kernels.enabled` names, torch elsewhere (and
    wherever a kernel declines its inputs)."""

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels, self.lib = kernels, kernels.lib
        self.name = f"cpu-{kernels.variant}"
        # Looked up once: these run per layer and step.
        self.c_norm, self.c_rotary, self.c_silu, self.c_gelu, self.c_vision, self.c_windows, self.c_delta = (
            kernels.uses(k)
            for k in (
                "rms_norm", "rotary", "silu_and_mul", "gelu_tanh", "vision_attention", "vision_windows",
                "delta_rule",
            )
        )  # fmt: skip

    def rms_norm(self, x, weight, eps):
        if self.c_norm:  # a strided x (a head's q within q and gate) is copied: torch's norm takes 10x
            fused = cpu_elementwise.rms_norm(self.lib, x.contiguous(), weight, eps)
            if fused is not None:
                return fused[1]
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x, delta, weight, eps):
        if self.c_norm:
            fused = cpu_elementwise.rms_norm(self.lib, x, weight, eps, delta)
            if fused is not None:
                return fused
        return super().add_rms_norm(x, delta, weight, eps)

    def rotary(self, x, cos, sin):
        if self.c_rotary and cpu_elementwise.rotary_(self.lib, x, cos, sin):
            return x
        return super().rotary(x, cos, sin)

    def silu_and_mul(self, x):
        if self.c_silu:
            fused = cpu_elementwise.silu_and_mul(self.lib, x)
            if fused is not None:
                return fused
        return super().silu_and_mul(x)

    def gelu_tanh(self, x):
        if self.c_gelu and cpu_elementwise.gelu_tanh_(self.lib, x):
            return x
        return super().gelu_tanh(x)

    def delta_rule_step_(self, state, slots, qkv, g, beta, key_heads):
        if self.c_delta:
            out = cpu_linear_attention.delta_rule_step_(self.lib, state, slots, qkv, g, beta, key_heads)
            if out is not None:
                return out
        return super().delta_rule_step_(state, slots, qkv, g, beta, key_heads)

    def conv_step_(self, conv, slots, x, weight):
        if self.c_delta:
            out = cpu_linear_attention.conv_step_(self.lib, conv, slots, x, weight)
            if out is not None:
                return out
        return super().conv_step_(conv, slots, x, weight)

    def gated_delta_decode_(self, conv, recurrent, slots, mixed, z, b, a, w):
        if self.c_delta and self.c_norm:
            c = cpu_linear_attention.gated_delta_decode_
            out = c(self.lib, conv, recurrent, slots, mixed, z, b, a, w)
            if out is not None:
                return out
        return super().gated_delta_decode_(conv, recurrent, slots, mixed, z, b, a, w)

    def gated_rms_norm(self, x, gate, weight, eps):
        if self.c_norm:
            out = cpu_elementwise.gated_rms_norm(self.lib, x, gate, weight, eps)
            if out is not None:
                return out
        return super().gated_rms_norm(x, gate, weight, eps)

    def varlen_attention(self, query, key, value, segments, scale):
        # A page-sized image (OCR: thousands of patches) goes to SDPA: the C kernel reads K and V
        # rows a whole token apart and lost to it there (kernels/cpu_kernels.py).
        if max(segments.lens) >= LONG_SEGMENT:
            return super().varlen_attention(query, key, value, segments, scale)
        if self.c_windows if segments.windows else self.c_vision:
            out = cpu_prefill.varlen(self.lib, query, key, value, segments.starts, segments.lens, scale)
            if out is not None:
                return out
        return super().varlen_attention(query, key, value, segments, scale)


class TritonOps(TorchOps):
    """The attention backend "triton"'s ops: the gated delta rule, the grouped experts and a vision
    tower's packed attention as Triton kernels (kernels/triton_gated_delta.py, triton_moe.py,
    triton_varlen.py), torch for the rest."""

    name = "triton"

    def __init__(self) -> None:
        from mm_engine.kernels import triton_gated_delta, triton_moe, triton_varlen

        self.delta, self.moe, self.attention = triton_gated_delta, triton_moe, triton_varlen

    def delta_rule_step_(self, state, slots, qkv, g, beta, key_heads):
        return self.delta.delta_rule_step_(state, slots, qkv, g, beta, key_heads)

    def delta_rule_chunked(self, q, k, v, g, beta, state):
        return self.delta.delta_rule_piece(q, k, v, g, beta, state)

    def varlen_attention(self, query, key, value, segments, scale):
        return self.attention.varlen(query, key, value, segments, scale)

    def moe_experts(self, x, token, expert, gate_up, down, act=None):
        if act is not None or gate_up.stride(-1) != 1 or down.stride(-1) != 1:
            return super().moe_experts(x, token, expert, gate_up, down, act)
        return self.moe.grouped_experts(x, token, expert, gate_up, down, self.silu_and_mul)


TORCH_OPS = TorchOps()


def ops_for(kernels: CpuKernels | None, backend: str = "torch") -> TorchOps:
    """`backend`: the resolved attention backend's name ("triton" brings its kernels)."""
    if backend == "triton":
        return TritonOps()
    return TORCH_OPS if kernels is None else CpuOps(kernels)
