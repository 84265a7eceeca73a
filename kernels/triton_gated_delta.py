"""The gated delta rule in Triton (the CUDA path of kernels/gated_delta.py's reference).

One program owns one value head and one block of its value columns: the state's columns are
independent under the update (the key side is whole in every program), so the state slice
`[key_dim, BLOCK_V]` stays in registers while the program walks its tokens. Decode is one token per
sequence, read and written in place at the sequence's pool row; a prefill piece walks its tokens in
order from the state the previous piece left (the recurrent form: the same products as the
reference's chunked form, summed in a different order, so equal to about 1e-6).

q and k are L2-normalised in the kernel and q scaled by `key_dim ** -0.5`; value head h reads key
head `h // (heads // key_heads)`, as transformers repeats them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

EPS = tl.constexpr(1e-6)  # gated_delta.l2_normalize's (a constexpr: compiled kernels read no other globals)


@triton.jit
def _normalised(x, scale):
    return x * (1.0 / tl.sqrt(tl.sum(x * x, 0) + EPS)) * scale


@triton.jit
def _update(s, q, k, v, g, beta):
    """One token: decay, write the delta, read. Returns the new state slice and the output."""
    s = s * tl.exp(g)
    delta = (v - tl.sum(s * k[:, None], 0)) * beta
    s = s + k[:, None] * delta[None, :]
    return s, tl.sum(s * q[:, None], 0)


@triton.jit
def _step_kernel(
    state, slots, qkv, qkv_stride, g, beta, out, scale,
    HEADS: tl.constexpr, KEY_HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    b, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kh = h // (HEADS // KEY_HEADS)
    ks = tl.arange(0, BLOCK_K)
    vs = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    km, vm = ks < DK, vs < DV
    row = qkv + b * qkv_stride
    q = _normalised(tl.load(row + kh * DK + ks, mask=km, other=0.0).to(tl.float32), scale)
    k = _normalised(tl.load(row + (KEY_HEADS + kh) * DK + ks, mask=km, other=0.0).to(tl.float32), 1.0)
    v = tl.load(row + 2 * KEY_HEADS * DK + h * DV + vs, mask=vm, other=0.0).to(tl.float32)
    slot = tl.load(slots + b).to(tl.int64)
    base = state + (slot * HEADS + h) * DK * DV + ks[:, None] * DV + vs[None, :]
    mask = km[:, None] & vm[None, :]
    s = tl.load(base, mask=mask, other=0.0)
    gb = tl.load(g + b * HEADS + h).to(tl.float32)
    bb = tl.load(beta + b * HEADS + h).to(tl.float32)
    s, o = _update(s, q, k, v, gb, bb)
    tl.store(base, s, mask=mask)
    tl.store(out + (b * HEADS + h) * DV + vs, o, mask=vm)


@triton.jit
def _piece_kernel(
    state, q, k, v, g, beta, out, n, scale,
    HEADS: tl.constexpr, KEY_HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    h, vb = tl.program_id(0), tl.program_id(1)
    kh = h // (HEADS // KEY_HEADS)
    ks = tl.arange(0, BLOCK_K)
    vs = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    km, vm = ks < DK, vs < DV
    base = state + h * DK * DV + ks[:, None] * DV + vs[None, :]
    mask = km[:, None] & vm[None, :]
    s = tl.load(base, mask=mask, other=0.0)
    for t in range(n):
        qt = _normalised(
            tl.load(q + (t * KEY_HEADS + kh) * DK + ks, mask=km, other=0.0).to(tl.float32), scale
        )
        kt = _normalised(tl.load(k + (t * KEY_HEADS + kh) * DK + ks, mask=km, other=0.0).to(tl.float32), 1.0)
        vt = tl.load(v + (t * HEADS + h) * DV + vs, mask=vm, other=0.0).to(tl.float32)
        gt = tl.load(g + t * HEADS + h).to(tl.float32)
        bt = tl.load(beta + t * HEADS + h).to(tl.float32)
        s, o = _update(s, qt, kt, vt, gt, bt)
        tl.store(out + (t * HEADS + h) * DV + vs, o, mask=vm)
    tl.store(base, s, mask=mask)


def _blocks(dk: int, dv: int) -> tuple[int, int]:
    # The whole key side per program; value columns in blocks small enough for the state slice
    # (key_dim x BLOCK_V float32) to stay in registers.
    return triton.next_power_of_2(dk), min(triton.next_power_of_2(dv), 32)


def delta_rule_step_(
    state: torch.Tensor, slots: torch.Tensor, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    key_heads: int,
) -> torch.Tensor:  # fmt: skip
    """TorchOps.delta_rule_step_'s contract: the pool `state` updated in place at rows `slots`."""
    batch = qkv.shape[0]
    heads, dk, dv = state.shape[1:]
    out = torch.empty(batch, heads, dv, dtype=torch.float32, device=qkv.device)
    if batch == 0:
        return out
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    bk, bv = _blocks(dk, dv)
    grid = (batch, heads, triton.cdiv(dv, bv))
    _step_kernel[grid](
        state, slots.contiguous(), qkv, qkv.stride(0), g.contiguous(), beta.contiguous(), out, dk**-0.5,
        heads, key_heads, dk, dv, bk, bv,
    )  # fmt: skip
    return out


def delta_rule_piece(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """gated_delta.delta_rule_chunked's contract (one sequence's n tokens from `state`)."""
    n, heads, dv = v.shape
    key_heads, dk = k.shape[1:]
    s = v.new_zeros(heads, dk, dv, dtype=torch.float32) if state is None else state.float().clone()
    out = torch.empty(n, heads, dv, dtype=torch.float32, device=v.device)
    if n == 0:
        return out, s
    bk, bv = _blocks(dk, dv)
    grid = (heads, triton.cdiv(dv, bv))
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    _piece_kernel[grid](s, q, k, v, g, beta, out, n, dk**-0.5, heads, key_heads, dk, dv, bk, bv)
    return out, s
