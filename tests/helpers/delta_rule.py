"""Inputs for the gated delta rule's kernels (the C and Triton decode steps), shared by their tests."""

from __future__ import annotations

import torch


def step_case(seed: int = 5):
    """A decode step against a state pool: (pool, slots, qkv, decay, beta, key_heads), with the
    sequences at scattered pool rows and qkv a view with a wider row, as after the conv."""
    g = torch.Generator().manual_seed(seed)
    key_heads, heads, dk, dv, batch = 2, 4, 32, 48, 3
    pool = torch.randn(6, heads, dk, dv, generator=g)
    slots = torch.tensor([4, 0, 2])
    wide = torch.randn(batch, 2 * key_heads * dk + heads * dv + 7, generator=g)
    qkv = wide[:, : 2 * key_heads * dk + heads * dv]
    decay, beta = -torch.rand(batch, heads, generator=g), torch.rand(batch, heads, generator=g)
    return pool, slots, qkv, decay, beta, key_heads
