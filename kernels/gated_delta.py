"""The gated delta rule (Gated DeltaNet, the linear-attention layers of Qwen3.5), torch reference.

Per value head a sequence carries a state `S` `[key_dim, value_dim]`; each token decays it by
`exp(g)`, writes the part of `v` that `S` does not already predict from `k` (the delta, scaled by
`beta`), and reads it with `q`:

    S <- exp(g) S;   S <- S + k (beta (v - k^T S))^T;   o = q^T S

Decode (one token) is that update as written. A prefill chunk of n tokens runs it in blocks of
`CHUNK` tokens: inside a block the n sequential updates collapse into a unit lower-triangular
solve plus matmuls (the WY form), and only the blocks are sequential. A chunk starts from the
state the previous chunk of the same sequence left, so a prompt split anywhere gives the same state.

The causal depthwise conv in front of it keeps the last `kernel - 1` inputs per sequence as its
state. Everything here is float32 inside (the recurrent state is kept in float32), whatever the
model's dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

CHUNK = 64


class DeltaWeights(NamedTuple):
    """What a linear-attention layer's decode step reads besides its inputs and states."""

    conv: torch.Tensor  # [channels, width]: the depthwise conv's taps
    a_log: torch.Tensor  # [heads]: the decay's log rate
    dt_bias: torch.Tensor  # [heads]
    norm: torch.Tensor  # [value_dim]: the gated RMSNorm's weight
    eps: float
    key_heads: int


def gates(b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor):
    """The write strength beta = sigmoid(b) and the decay g = -exp(A_log) softplus(a + dt_bias),
    `[tokens, heads]` each (g in float32)."""
    return b.sigmoid(), -a_log.float().exp() * F.softplus(a.float() + dt_bias)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's depthwise causal conv + SiLU: `x` `[n, channels]`, `weight` `[channels,
    kernel]`, `state` `[channels, kernel - 1]` (the inputs before `x`; None: zeros). Returns the
    output `[n, channels]` and the new state."""
    k = weight.shape[1]
    if state is None:
        state = x.new_zeros(x.shape[1], k - 1)
    full = torch.cat([state.to(x.dtype), x.t()], dim=1)  # [channels, k - 1 + n]
    out = F.conv1d(full.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), groups=weight.shape[0])
    return F.silu(out[0]).t().to(x.dtype), full[:, -(k - 1) :]


def causal_conv_step(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of a batch of sequences: `x` `[batch, channels]`, `state` `[batch,
    channels, kernel - 1]`. Returns `[batch, channels]` and the new states."""
    window = torch.cat([state.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [batch, channels, kernel]
    out = (window.to(weight.dtype) * weight).sum(-1)
    return F.silu(out).to(x.dtype), window[..., 1:]


def _heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k normalised, q scaled, each key head repeated for the value heads it serves."""
    rep = v.shape[-2] // k.shape[-2]
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    q = q * q.shape[-1] ** -0.5
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
    return q, k


def delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of a batch of sequences: q, k `[batch, key_heads, key_dim]`, v `[batch,
    heads, value_dim]`, g and beta `[batch, heads]`, state `[batch, heads, key_dim, value_dim]`
    (float32). Returns the output `[batch, heads, value_dim]` (float32) and the new state."""
    q, k = _heads(q, k, v)
    s = state * g.float().exp()[..., None, None]
    predicted = torch.einsum("bhkv,bhk->bhv", s, k)
    delta = (v.float() - predicted) * beta.float()[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", s, q), s


def delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's chunk of n tokens: q, k `[n, key_heads, key_dim]`, v `[n, heads,
    value_dim]`, g and beta `[n, heads]`, state `[heads, key_dim, value_dim]` or None (zeros).
    Returns the output `[n, heads, value_dim]` (float32) and the state after the last token."""
    n, heads, dv = v.shape
    q, k = _heads(q, k, v)
    # Heads first, padded to whole blocks: [heads, blocks, CHUNK, dim].
    pad = (-n) % CHUNK
    blocks = (n + pad) // CHUNK

    def split(x: torch.Tensor) -> torch.Tensor:
        x = x.float().transpose(0, 1)
        x = F.pad(x, (0, 0, 0, pad)) if x.dim() == 3 else F.pad(x, (0, pad))
        return x.reshape(heads, blocks, CHUNK, *x.shape[2:])

    q, k, v, g, beta = (split(x) for x in (q, k, v, g, beta))
    decay = g.cumsum(-1)  # log of the decay from the block's start to each token (inclusive)
    # exp(decay_i - decay_j) for j <= i: what token j's write has decayed to when token i reads.
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kb = k * beta[..., None]
    # (I + strictly lower part of A) W = B, with A_ij = beta_i k_i.k_j decay_ij: the n updates at once.
    system = (kb @ k.transpose(-1, -2)) * pair
    values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    keys = torch.linalg.solve_triangular(system, kb * decay.exp()[..., None], upper=False, unitriangular=True)
    inner = (q @ k.transpose(-1, -2)) * pair  # intra-block attention, decay included
    q_read = q * decay.exp()[..., None]  # reads the state as it stood at the block's start
    k_write = k * (decay[..., -1:] - decay).exp()[..., None]  # each write, decayed to the block's end
    block_decay = decay[..., -1].exp()[..., None, None]
    s = q.new_zeros(heads, q.shape[-1], dv) if state is None else state.float()
    out = torch.empty(heads, blocks, CHUNK, dv, dtype=torch.float32, device=q.device)
    for b in range(blocks):
        fresh = values[:, b] - keys[:, b] @ s  # the part of each value the state does not predict
        out[:, b] = q_read[:, b] @ s + inner[:, b] @ fresh
        s = s * block_decay[:, b] + k_write[:, b].transpose(-1, -2) @ fresh
    return out.reshape(heads, -1, dv)[:, :n].transpose(0, 1), s


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of `x` (in float32), times `weight`, times SiLU of `gate`."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return ((weight * x.to(dtype)) * F.silu(gate.float())).to(dtype)
