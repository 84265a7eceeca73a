"""The recurrent-state pool: one slot per sequence, given back once, saved and restored whole."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mm_engine.pools.state_pool import StatePool, StateSpec

SPEC = StateSpec(
    num_layers=2, conv_channels=6, conv_kernel=3, num_heads=2, key_dim=4, value_dim=5, dtype=torch.float16
)


def req(rid: str):
    return SimpleNamespace(request_id=rid, state_slot=None)


def test_bytes_per_slot_counts_both_states_of_every_layer():
    assert SPEC.bytes_per_slot == 2 * (6 * 2 * 2 + 2 * 4 * 5 * 4)


def test_slots_are_handed_out_once_and_given_back():
    pool = StatePool(SPEC, 2, torch.device("cpu"))
    a, b, c = req("a"), req("b"), req("c")
    pool.allocate(a)
    pool.allocate(a)  # already holds one: nothing changes
    pool.allocate(b)
    assert {a.state_slot, b.state_slot} == {0, 1} and pool.num_free == 0
    with pytest.raises(RuntimeError, match="no free state slot"):
        pool.allocate(c)
    pool.free(a)
    pool.free(a)  # holds none now: nothing to give back
    assert a.state_slot is None and pool.num_used == 1
    pool.allocate(c)
    stranger = SimpleNamespace(request_id="x", state_slot=c.state_slot)
    with pytest.raises(RuntimeError, match="not held by request 'x'"):
        pool.free(stranger)
    assert pool.report() == {"slots": 2, "used": 2, "free": 0, "bytes_per_slot": SPEC.bytes_per_slot,
                             "bytes": 2 * SPEC.bytes_per_slot}  # fmt: skip


def test_save_and_load_move_a_slot_whole():
    pool = StatePool(SPEC, 3, torch.device("cpu"))
    for t in (*pool.conv, *pool.recurrent):
        t[1] = torch.randn(t[1].shape).to(t.dtype)
    saved = pool.save(1)
    pool.load(2, saved)
    for t in (*pool.conv, *pool.recurrent):
        assert torch.equal(t[2], t[1])
    assert pool.recurrent[0].dtype == torch.float32 and pool.conv[0].dtype == torch.float16


def test_a_pool_needs_a_slot():
    with pytest.raises(ValueError, match="at least one slot"):
        StatePool(SPEC, 0, torch.device("cpu"))


def test_a_tensor_parallel_split_must_divide_the_linear_attention_heads():
    from types import SimpleNamespace

    from mm_engine.parallel.group import check_divisible

    cfg = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2, intermediate_size=64,
                          linear_num_key_heads=2, linear_num_value_heads=6)  # fmt: skip
    check_divisible(cfg, 2)
    with pytest.raises(ValueError, match="does not divide the language model's linear_num_value_heads"):
        check_divisible(SimpleNamespace(**{**vars(cfg), "linear_num_value_heads": 5}), 2)
    with pytest.raises(ValueError, match="linear_num_key_heads"):
        check_divisible(SimpleNamespace(**{**vars(cfg), "linear_num_key_heads": 1}), 2)
