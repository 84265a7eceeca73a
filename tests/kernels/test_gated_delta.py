"""The gated delta rule and its causal conv (kernels/gated_delta.py) against transformers' Qwen3.5
reference functions: whole prompts, prompts split anywhere (each chunk continuing from the state
the last one left), and token-by-token decode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

from helpers.delta_rule import step_case
from mm_engine.kernels import gated_delta as gd


def inputs(n: int, seed: int = 0, key_heads: int = 2, heads: int = 4, dim: int = 32):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(n, key_heads, dim, generator=g) for _ in range(2))
    v = torch.randn(n, heads, dim, generator=g)
    decay = -torch.rand(n, heads, generator=g) * 2
    beta = torch.rand(n, heads, generator=g)
    return q, k, v, decay, beta


def reference(q, k, v, decay, beta):
    out, state = torch_chunk_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        decay[None],
        beta[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return out[0], state[0]


@pytest.mark.parametrize("n", [1, 7, 64, 150])
def test_a_whole_prompt_equals_transformers(n):
    want_out, want_state = reference(*inputs(n))
    out, state = gd.delta_rule_chunked(*inputs(n), None)
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=0, atol=1e-5)


@pytest.mark.parametrize("cuts", [[1], [5, 60], [64, 70], [3, 4, 100, 149]])
def test_chunks_continue_from_the_state_the_last_one_left(cuts):
    n = 150
    q, k, v, decay, beta = inputs(n, seed=1)
    want_out, want_state = reference(q, k, v, decay, beta)
    outs, state = [], None
    for a, b in zip([0, *cuts], [*cuts, n], strict=True):
        o, state = gd.delta_rule_chunked(q[a:b], k[a:b], v[a:b], decay[a:b], beta[a:b], state)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs), want_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=0, atol=1e-5)


def test_decode_steps_of_a_batch_equal_the_chunked_form():
    n, batch = 40, 3
    per_seq = [inputs(n, seed=10 + i) for i in range(batch)]
    states = torch.stack([gd.delta_rule_chunked(*(x[:20] for x in s), None)[1] for s in per_seq])
    for t in range(20, n):
        step = [torch.stack([s[j][t] for s in per_seq]) for j in range(5)]
        out, states = gd.delta_rule_step(*step, states)
        for i, s in enumerate(per_seq):
            want = gd.delta_rule_chunked(*(x[: t + 1] for x in s), None)[0][t]
            torch.testing.assert_close(out[i], want, rtol=0, atol=1e-5)


def test_the_causal_conv_split_anywhere_equals_one_pass():
    g = torch.Generator().manual_seed(3)
    x, weight = torch.randn(30, 12, generator=g), torch.randn(12, 4, generator=g)
    full = F.silu(F.conv1d(x.t()[None], weight[:, None], padding=3, groups=12)[0, :, :30]).t()
    out1, state = gd.causal_conv(x[:2], weight, None)  # shorter than the kernel's history
    out2, state = gd.causal_conv(x[2:20], weight, state)
    outs = [out1, out2]
    for t in range(20, 30):
        o, s = gd.causal_conv_step(x[t][None], weight, state[None])
        outs.append(o)
        state = s[0]
    torch.testing.assert_close(torch.cat(outs), full, rtol=0, atol=1e-5)


def test_the_c_decode_step_updates_the_pool_in_place_as_the_torch_path(cpu_lib):
    from mm_engine.kernels import cpu_linear_attention
    from mm_engine.kernels.ops import TORCH_OPS

    pool, slots, qkv, decay, beta, key_heads = step_case()
    want_pool = pool.clone()
    want = TORCH_OPS.delta_rule_step_(want_pool, slots, qkv, decay, beta, key_heads)
    got = cpu_linear_attention.delta_rule_step_(cpu_lib, pool, slots, qkv, decay, beta, key_heads)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        pool, want_pool, rtol=1e-5, atol=1e-5
    )  # other rows untouched, its rows updated
    assert cpu_linear_attention.delta_rule_step_(cpu_lib, pool.double(), slots, qkv, decay, beta, 2) is None


@pytest.mark.parametrize("width", [4, 3])  # Qwen3.5's, unrolled; and the general loop
def test_the_c_conv_step_updates_the_pool_in_place_as_the_torch_path(cpu_lib, width):
    from mm_engine.kernels import cpu_linear_attention
    from mm_engine.kernels.ops import TORCH_OPS

    g = torch.Generator().manual_seed(4)
    pool, weight = torch.randn(6, 40, width - 1, generator=g), torch.randn(40, width, generator=g)
    wide = torch.randn(3, 70, generator=g)  # the inputs a view into a wider projection, as in the model
    x, slots = wide[:, 10:50], torch.tensor([4, 0, 2])
    want_pool = pool.clone()
    want = TORCH_OPS.conv_step_(want_pool, slots, x, weight)
    got = cpu_linear_attention.conv_step_(cpu_lib, pool, slots, x, weight)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pool, want_pool, rtol=0, atol=0)  # rows 1, 3, 5 untouched; the rest shifted
    assert cpu_linear_attention.conv_step_(cpu_lib, pool.double(), slots, x.double(), weight.double()) is None


def test_the_c_gated_norm_equals_the_torch_one(cpu_lib):
    from mm_engine.kernels import cpu_elementwise

    g = torch.Generator().manual_seed(5)
    x, gate = torch.randn(7, 128, generator=g), torch.randn(7, 128, generator=g)
    weight = torch.rand(128, generator=g)
    x[3] = 0  # an all-zero row stays zero
    got = cpu_elementwise.gated_rms_norm(cpu_lib, x, gate, weight, 1e-6)
    torch.testing.assert_close(got, gd.gated_rms_norm(x, gate, weight, 1e-6), rtol=1e-5, atol=1e-6)
    assert cpu_elementwise.gated_rms_norm(cpu_lib, x, gate.t(), weight, 1e-6) is None  # not row-major


@pytest.mark.parametrize("batch", [1, 3])
def test_the_c_linear_attention_decode_equals_the_torch_ops_it_fuses(cpu_lib, batch):
    """Conv step, gates, delta rule and gated norm in one C call, against TorchOps' composition of
    the same steps: both pools updated in place at the sequences' rows only. The inputs are views
    into one projection as in the model, and the gates cover softplus' pass-through (a + dt_bias
    past 20) and both signs of b."""
    from mm_engine.kernels import cpu_linear_attention
    from mm_engine.kernels.ops import TORCH_OPS

    g = torch.Generator().manual_seed(6)
    key_heads, heads, dk, dv, width = 2, 4, 32, 48, 4
    channels = 2 * key_heads * dk + heads * dv
    conv, state = torch.randn(6, channels, width - 1, generator=g), torch.randn(6, heads, dk, dv, generator=g)
    proj = torch.randn(batch, channels + heads * dv + 2 * heads, generator=g)
    proj[:, -heads:] *= 12  # a: softplus' both branches
    mixed, z, b, a = proj.split([channels, heads * dv, heads, heads], -1)
    slots = torch.tensor([4, 0, 2][:batch])
    taps, a_log, dt_bias = (
        torch.randn(channels, width, generator=g),
        torch.rand(heads, generator=g),
        torch.rand(heads, generator=g),
    )
    w = gd.DeltaWeights(taps, a_log, dt_bias * 4, torch.rand(dv, generator=g) + 0.5, 1e-6, key_heads)
    want_conv, want_state = conv.clone(), state.clone()
    want = TORCH_OPS.gated_delta_decode_(want_conv, want_state, slots, mixed, z, b, a, w)
    got = cpu_linear_attention.gated_delta_decode_(cpu_lib, conv, state, slots, mixed, z, b, a, w)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(conv, want_conv, rtol=0, atol=0)
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-5)
    assert (
        cpu_linear_attention.gated_delta_decode_(cpu_lib, conv, state.double(), slots, mixed, z, b, a, w)
        is None
    )
