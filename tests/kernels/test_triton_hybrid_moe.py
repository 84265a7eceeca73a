"""The Triton gated delta rule and grouped experts (kernels/triton_gated_delta.py, triton_moe.py),
run by the Triton interpreter on CPU tensors, or compiled on a GPU with MM_ENGINE_TEST_DEVICE=cuda,
against the torch reference (kernels/gated_delta.py) and a per-token loop over experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.delta_rule import step_case
from helpers.device import TEST_DEVICE
from mm_engine.kernels import gated_delta as gd
from mm_engine.kernels import triton_gated_delta, triton_moe
from mm_engine.kernels.ops import TORCH_OPS, TritonOps


def delta_inputs(n: int, seed: int, key_heads: int = 2, heads: int = 4, dk: int = 32, dv: int = 48):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(n, key_heads, dk, generator=g) for _ in range(2))
    v = torch.randn(n, heads, dv, generator=g)
    return q, k, v, -torch.rand(n, heads, generator=g) * 2, torch.rand(n, heads, generator=g)


def on(*xs):
    return [x.to(TEST_DEVICE) for x in xs]


def test_decode_step_updates_only_its_pool_rows_as_the_torch_path():
    pool, slots, qkv, decay, beta, key_heads = step_case()
    want_pool = pool.clone()
    want = TORCH_OPS.delta_rule_step_(want_pool, slots, qkv, decay, beta, key_heads)
    got_pool, *args = on(pool, slots, qkv, decay, beta)
    got = triton_gated_delta.delta_rule_step_(got_pool, *args, key_heads)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_pool.cpu(), want_pool, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cuts", [[], [1], [5, 30]])
def test_prefill_pieces_continue_from_the_state_and_equal_the_chunked_reference(cuts):
    n = 40
    q, k, v, decay, beta = delta_inputs(n, seed=1)
    want_out, want_state = gd.delta_rule_chunked(q, k, v, decay, beta, None)
    outs, state = [], None
    for a, b in zip([0, *cuts], [*cuts, n], strict=True):
        o, state = triton_gated_delta.delta_rule_piece(
            *on(q[a:b], k[a:b], v[a:b], decay[a:b], beta[a:b]), state
        )
        outs.append(o.cpu())
    torch.testing.assert_close(torch.cat(outs), want_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(state.cpu(), want_state, rtol=0, atol=1e-5)


def test_a_head_dim_that_is_not_a_power_of_two():
    q, k, v, decay, beta = delta_inputs(9, seed=2, key_heads=1, heads=3, dk=24, dv=40)
    start = torch.randn(3, 24, 40, generator=torch.Generator().manual_seed(0))
    want_out, want_state = gd.delta_rule_chunked(q, k, v, decay, beta, start)
    out, state = triton_gated_delta.delta_rule_piece(*on(q, k, v, decay, beta, start))
    torch.testing.assert_close(out.cpu(), want_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(state.cpu(), want_state, rtol=0, atol=1e-5)


def experts(num: int, hidden: int, width: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num, hidden, 2 * width, generator=g) * 0.3, torch.randn(
        num, width, hidden, generator=g
    ) * 0.3


@pytest.mark.parametrize("tokens,num,top_k", [(1, 4, 2), (5, 6, 2), (37, 8, 3)])
def test_grouped_experts_equal_a_loop_over_tokens(tokens, num, top_k):
    hidden, width = 24, 20  # neither a power of two nor a whole tile
    gate_up, down = experts(num, hidden, width, seed=tokens)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(7))
    chosen = torch.stack(
        [torch.randperm(num, generator=torch.Generator().manual_seed(t))[:top_k] for t in range(tokens)]
    )
    flat = chosen.reshape(-1)
    order = flat.argsort(stable=True)
    token, expert = order // top_k, flat[order]
    want = torch.stack([
        (F.silu(x[t] @ gate_up[e, :, :width]) * (x[t] @ gate_up[e, :, width:])) @ down[e]
        for t, e in zip(token.tolist(), expert.tolist(), strict=True)
    ])  # fmt: skip
    got = triton_moe.grouped_experts(*on(x, token, expert, gate_up, down), TORCH_OPS.silu_and_mul)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        TORCH_OPS.moe_experts(x, token, expert, gate_up, down), want, rtol=1e-4, atol=1e-4
    )


def test_the_triton_ops_decline_what_their_kernels_do_not_cover():
    gate_up, down = experts(3, 16, 8, seed=0)
    x = torch.randn(4, 16)
    token, expert = torch.tensor([0, 2, 1, 3]), torch.tensor([0, 0, 1, 2])
    want = TORCH_OPS.moe_experts(x, token, expert, gate_up, down, torch.tanh)  # not SiLU: torch
    torch.testing.assert_close(TritonOps().moe_experts(x, token, expert, gate_up, down, torch.tanh), want)
