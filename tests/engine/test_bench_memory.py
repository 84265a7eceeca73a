"""bench.memory's measurement on a tiny checkpoint: its waste figures are sane, nothing leaks, and
with long-tailed outputs the pools hold more sequences than a static cache of the same bytes."""

from __future__ import annotations

import pytest
import torch

from bench.memory import POOLS, Item, measure, static_cache_bytes
from helpers.images import make_image
from mm_engine import LLM
from mm_engine.pools.block_manager import IMAGE

BLOCK = 8
PROMPT = "USER: <image> what is this ASSISTANT:"


def _items() -> list[Item]:
    """Mostly short outputs, two long ones: the static cache must size every slot for the long."""
    items = []
    for k in range(24):
        out = 64 if k in (3, 17) else 3 + k % 6
        if k % 4 == 3:
            items.append(Item("text", "USER: what is this ASSISTANT:", out))
        else:
            # Every other image request reuses its predecessor's picture: shared prefix blocks.
            image = make_image(k // 2)
            items.append(Item("caption", {"prompt": PROMPT, "multi_modal_data": {"image": image}}, out))
    return items


@pytest.fixture
def one_thread():
    # Tiny matmuls gain nothing from a second OpenMP thread, and lose a lot (measured 100x here)
    # when another job keeps one of the two cores busy.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("drain", [True, False])
def test_measure_on_tiny_checkpoint(clip_llama, one_thread, drain):
    budget = 768 << 10  # 48 blocks of 8 tokens at 2 KiB per token
    llm = LLM(
        clip_llama, kv_cache_memory_bytes=budget, block_size=BLOCK, max_num_seqs=64, scheduling_policy="fcfs"
    )
    items = _items()
    r = measure(llm, items, budget, drain=drain)

    assert r["steps"] > 0 and r["queued_steps"] > 0
    for s in r["timeline"]:
        for pool in POOLS:
            assert 0 <= s[pool]["filled"] <= s[pool]["allocated"]
            assert s[pool]["held"] == s[pool]["used"]  # every used block belongs to a running request
    for figures in (r["kv_waste"], r["kv_waste_at_peak"]):
        assert all(0.0 <= w < 1.0 for w in figures.values())
        assert figures["overall"] > 0.0  # partial last blocks exist
    assert r["prefix_cache_hits"][IMAGE] > 0  # shared blocks were in play, and counted once
    assert r["untracked_blocks_max"] == 0
    assert r["leaked_blocks"] == {"text": 0, "image": 0}
    assert not llm.engine.has_unfinished()

    # The static cache is sized for the longest prompt plus the longest output.
    assert r["hf_max_len"] == max(r["prompt_lens"]) + 64
    assert r["hf_seqs"] == budget // r["hf_bytes_per_seq"] >= 1
    assert r["seqs_max"] > r["hf_seqs"] and r["seqs_mean"] > r["hf_seqs"]
    assert r["concurrent_seqs_ratio"] == pytest.approx(r["seqs_mean"] / r["hf_seqs"])
    if drain:
        assert r["steps"] > r["queued_steps"]  # it went on after the queue emptied


def test_static_cache_bytes_are_allocated_for_real(clip_llama):
    cfg = LLM(clip_llama, kv_cache_memory_bytes=1 << 20).engine.core.hf_config.text_config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    expected = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 100 * 4
    assert static_cache_bytes(cfg, 100, torch.float32) == expected
    assert static_cache_bytes(cfg, 100, torch.float16) == expected // 2
