"""Qwen3.5's hybrid model beyond the shared Qwen tests (test_qwen_vl.py): the recurrent-state
pool (one slot per running sequence, freed on finish, abort and preemption, carried by swap),
the seat limit it sets, sampled `n > 1` (each sample its own copy of the prompt's state), and
the refusals."""

from __future__ import annotations

import pytest

from helpers.families import assert_all_free, engine, family_prompt, greedy, mm
from helpers.images import make_image
from mm_engine import SamplingParams
from mm_engine.core.reports import core_stats
from mm_engine.core.types import CoreRequest

# The tiny checkpoint's state slot: 3 linear layers x (conv 256 x 3 + recurrent 4 x 32 x 32) floats.
SLOT_BYTES = 3 * (256 * 3 + 4 * 32 * 32) * 4
BLOCK_BYTES = 2 * 8 * 2 * 32 * 4  # one full-attention layer, 8 tokens a block


def prompt(question: str, n_images: int = 0) -> str:
    return family_prompt("qwen3_5", question, n_images)


CASES = [
    (prompt("what is this", 1), [make_image(1, (70, 45))], 9),
    (prompt("which is left", 2), [make_image(2, (120, 100)), make_image(3, (30, 64))], 7),
    (prompt("how many shapes are there"), [], 8),
    (prompt("describe the picture", 1), [make_image(4, (40, 90))], 10),
]


@pytest.fixture(scope="module")
def hybrid(vl_family):
    return vl_family("qwen3_5")


def memory(blocks: int, slots: int) -> dict:
    """Engine memory for exactly `slots` state slots and `blocks` KV blocks."""
    total = blocks * BLOCK_BYTES + slots * SLOT_BYTES
    return dict(kv_cache_memory_bytes=total, max_state_memory_fraction=(slots * SLOT_BYTES + 1) / total)


def assert_no_state_held(llm) -> None:
    state = llm.kv_report()["state"]
    assert state["used"] == 0 and state["free"] == state["slots"]


def test_the_state_pool_is_sized_reported_and_freed(hybrid):
    path, ref = hybrid
    llm = engine(path, "torch", **memory(40, 3))
    state = llm.kv_report()["state"]
    assert (state["slots"], state["bytes_per_slot"], state["bytes"]) == (3, SLOT_BYTES, 3 * SLOT_BYTES)
    assert llm.kv_report()["text"]["total_blocks"] + llm.kv_report()["image"]["total_blocks"] == 40
    assert llm.engine.core.scheduler.max_num_seqs == 3  # a seat per slot
    outs = llm.generate([mm(p, i) for p, i, _ in CASES * 2], [greedy(n) for *_, n in CASES * 2])
    for out, (text, imgs, n) in zip(outs, CASES * 2, strict=True):
        assert out.outputs[0].token_ids == ref.generate(text, imgs, n), text
    assert_no_state_held(llm)
    assert_all_free(llm)
    assert core_stats(llm.engine.core)["state_slots_total"] == 3


def test_swap_preemption_carries_the_state(hybrid):
    path, ref = hybrid
    llm = engine(path, "torch", preemption_mode="swap", image_pool_fraction=0.3, **memory(24, 8))
    batch = CASES * 2
    outs = llm.generate([mm(p, i) for p, i, _ in batch], [greedy(n + 6) for *_, n in batch])
    report = llm.kv_report()
    assert llm.engine.core.scheduler.num_preemptions > 0 and report["swap"]["swapped_in_blocks"] > 0
    for out, (text, imgs, n) in zip(outs, batch, strict=True):
        assert out.outputs[0].token_ids == ref.generate(text, imgs, n + 6), text
    assert_no_state_held(llm)
    assert_all_free(llm)
    assert report["swap"]["host_bytes_used"] == 0


def test_each_sample_of_n_continues_from_its_own_copy_of_the_prompt_state(hybrid):
    path, _ = hybrid
    llm = engine(path, "torch", **memory(40, 4))
    text, imgs, _ = CASES[0]
    sampled = SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=7)
    together = llm.generate(mm(text, imgs), sampled)[0].outputs
    alone = [
        llm.generate(mm(text, imgs), SamplingParams(temperature=1.0, max_tokens=8, seed=7 + i))[0].outputs[0]
        for i in range(3)
    ]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert len({tuple(o.token_ids) for o in together}) > 1  # the samples did differ
    assert_no_state_held(llm)


def test_aborted_and_finished_requests_give_their_slots_back(hybrid):
    path, _ = hybrid
    llm = engine(path, "torch", **memory(40, 2))
    core = llm.engine.core
    ids = llm.engine.inputs.process(mm(prompt("how many shapes are there"), []))[1]
    for k in range(3):
        core.add(CoreRequest(f"r{k}", ids, [], greedy(50), eos_token_ids=frozenset()))
    for _ in range(4):
        core.step()
    assert llm.kv_report()["state"]["used"] == 2 and len(core.scheduler.waiting) == 1  # two seats
    core.abort("r0")
    for _ in range(3):
        core.step()
    assert llm.kv_report()["state"]["used"] == 2  # r2 took r0's slot
    core.abort("r1")
    core.abort("r2")
    assert_no_state_held(llm)
    assert_all_free(llm)


def test_video_placeholders_and_prefix_caching(hybrid):
    path, _ = hybrid
    llm = engine(path, "torch")
    with pytest.raises(ValueError, match="video placeholder .* video input is not supported yet"):
        llm.generate(mm("<|im_start|>user <|vision_start|><|video_pad|><|vision_end|> hi", []), greedy(2))
    assert not llm.engine.core.blocks.enable_prefix_caching  # a KV prefix is no use without the state
    assert llm.generate(mm(prompt("what is this"), []), greedy(2))[0].finished  # still serving


def test_a_state_that_does_not_fit_is_refused_by_name(hybrid):
    path, _ = hybrid
    with pytest.raises(ValueError, match="recurrent state takes 58368 bytes"):
        engine(path, "torch", kv_cache_memory_bytes=64 * 1024)
