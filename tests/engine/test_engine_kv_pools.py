"""The two pools: image-token blocks live in the image pool, everything else in the text pool, and
every block is free again when requests end, whatever happened to them."""

from __future__ import annotations

import pytest

from helpers.images import make_image
from mm_engine import LLM, SamplingParams
from mm_engine.pools.block_manager import IMAGE, TEXT


def _image_prompt(n_images: int, words: str = "what is this") -> dict:
    return {
        "prompt": "USER: " + "<image> " * n_images + words + " ASSISTANT:",
        "multi_modal_data": {"image": [make_image(10 + k) for k in range(n_images)]},
    }


def _expected_image_blocks(req, block_size: int) -> list[bool]:
    """Recomputed here from the token ids, not from the engine's own bookkeeping."""
    flags = []
    ids = req.prompt_token_ids
    for i in range(len(req.block_table)):
        lo, hi = i * block_size, (i + 1) * block_size
        flags.append(hi <= len(ids) and all(span_has(req, p) for p in range(lo, hi)))
    return flags


def span_has(req, pos: int) -> bool:
    return any(s.offset <= pos < s.offset + s.length for s in req.images)


@pytest.mark.parametrize("block_size", [8, 16])
def test_image_pool_holds_exactly_the_image_token_blocks(clip_llama, block_size):
    llm = LLM(clip_llama, kv_cache_memory_bytes=8 * 1024**2, block_size=block_size, max_num_batched_tokens=24)
    engine = llm.engine
    prompts = [_image_prompt(n, "describe " * k) for k, n in enumerate([0, 1, 2, 1, 3, 0, 2])]
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=5 + i, ignore_eos=True))
    saw_image_blocks = False
    while engine.has_unfinished():
        engine.step()
        image_pool = engine.core.blocks.pools[IMAGE]
        held = []
        for req in engine.core.scheduler.running:
            for block, is_image in zip(req.block_table, _expected_image_blocks(req, block_size), strict=True):
                assert (block in image_pool) == is_image, (req.request_id, block)
                held.append(block)
        # A block may sit in several tables (a shared prefix: same image, same words before it).
        held = set(held)
        image_held = {b for b in held if b in image_pool}
        assert image_pool.num_used == len(image_held)
        assert engine.core.blocks.pools[TEXT].num_used == len(held) - len(image_held)
        report = llm.kv_report()
        assert report[IMAGE]["used_blocks"] == len(image_held)
        # Image blocks are full by definition once computed; allocated >= filled everywhere.
        for pool in (TEXT, IMAGE):
            assert report[pool]["filled_slots"] <= report[pool]["allocated_slots"]
        saw_image_blocks |= bool(image_held)
    assert saw_image_blocks
    report = llm.kv_report()
    for pool in (TEXT, IMAGE):
        assert report[pool]["used_blocks"] == 0
        assert report[pool]["free_blocks"] + report[pool]["cached_blocks"] == report[pool]["total_blocks"]
        assert report[pool]["filled_slots"] == report[pool]["allocated_slots"] == 0


def test_kv_report_counts_slots(clip_llama):
    llm = LLM(clip_llama, kv_cache_memory_bytes=8 * 1024**2, block_size=8)
    engine = llm.engine
    engine.add_request(_image_prompt(1), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()  # the whole prompt in one chunk, plus the first token sampled
    req = engine.core.scheduler.running[0]
    report = llm.kv_report()
    n = req.num_computed_tokens
    assert report[TEXT]["filled_slots"] + report[IMAGE]["filled_slots"] == n
    # "USER:" then 16 image tokens at positions 1..16: only block [8, 16) is all image tokens.
    assert req.images[0].offset == 1 and req.images[0].length == 16
    assert report[IMAGE]["filled_slots"] == 8
    assert report[IMAGE]["used_blocks"] == 1
    assert report[TEXT]["allocated_slots"] + report[IMAGE]["allocated_slots"] == 8 * len(req.block_table)


def test_preemption_when_a_pool_runs_out_keeps_outputs(clip_llama):
    """A KV budget too small for the whole batch: requests are preempted and recomputed, and every
    output is still what it is when run alone."""
    prompts = [_image_prompt(1, "what is this " * (i % 3)) for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=20 + 3 * i, ignore_eos=True) for i in range(6)]
    alone = LLM(clip_llama, kv_cache_memory_bytes=8 * 1024**2)
    expected = [alone.generate(p, sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    # 2 layers * 4 kv heads * 32 dims * 2 (K, V) * 4 bytes * 8 slots = 16 KiB per block.
    tight = LLM(clip_llama, kv_cache_memory_bytes=16 * 1024 * 20, block_size=8, image_pool_fraction=0.4)
    outs = tight.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert tight.engine.core.scheduler.num_preemptions > 0
    report = tight.kv_report()
    assert report[TEXT]["used_blocks"] == report[IMAGE]["used_blocks"] == 0


def test_request_that_can_never_fit_is_refused(clip_llama):
    llm = LLM(clip_llama, kv_cache_memory_bytes=16 * 1024 * 6, block_size=8, image_pool_fraction=0.5)
    with pytest.raises(ValueError, match="image-pool blocks"):
        llm.generate(_image_prompt(3), SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="text-pool blocks"):
        llm.generate("USER: what is this ASSISTANT:", SamplingParams(max_tokens=200))
    report = llm.kv_report()
    assert report[TEXT]["used_blocks"] == report[IMAGE]["used_blocks"] == 0
    # The engine still serves what fits.
    out = llm.generate("USER: what ASSISTANT:", SamplingParams(max_tokens=3, temperature=0))
    assert out[0].finished


def test_kv_report_counts_a_shared_prefix_block_once(clip_llama):
    llm = LLM(clip_llama, kv_cache_memory_bytes=8 * 1024**2, block_size=8)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request(_image_prompt(1, "describe"), params)
    engine.step()
    engine.add_request(_image_prompt(1, "describe the"), params)  # same image: reuses its blocks
    engine.step()
    a, b = engine.core.scheduler.running
    shared = set(a.block_table) & set(b.block_table)
    assert shared, "the second request reused the first one's prefix blocks"
    report = llm.kv_report()
    filled = report[TEXT]["filled_slots"] + report[IMAGE]["filled_slots"]
    held = len(set(a.block_table) | set(b.block_table))
    assert filled == a.num_computed_tokens + b.num_computed_tokens - 8 * len(shared)
    assert report[TEXT]["used_blocks"] + report[IMAGE]["used_blocks"] == held
    for pool in (TEXT, IMAGE):
        assert report[pool]["filled_slots"] <= report[pool]["allocated_slots"]
