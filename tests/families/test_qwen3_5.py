"""Qwen3.5's hybrid model beyond the shared Qwen tests (test_qwen_vl.py): the recurrent-state
pool (one slot per running sequence, freed on finish, abort and preemption, carried by swap),
the seat limit it sets, sampled `n > 1` (each sample its own copy of the prompt's state), and
the refusals."""

from __future__ import annotations

import pytest

from helpers.api import data_url, image_bytes
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


def memory(blocks: int, slots: int, snapshots: int = 0) -> dict:
    """Engine memory for exactly `slots` state slots, `snapshots` snapshot rows (0, or as many as
    the slots: with snapshots the slots take half the state rows) and `blocks` KV blocks."""
    rows = slots + snapshots
    total = blocks * BLOCK_BYTES + rows * SLOT_BYTES
    fraction = (rows * SLOT_BYTES + 1) / total
    return dict(
        kv_cache_memory_bytes=total, max_state_memory_fraction=fraction, num_state_snapshots=snapshots
    )


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


def test_a_video_placeholder_without_its_clip_is_refused_by_name(hybrid):
    path, _ = hybrid
    llm = engine(path, "torch")
    with pytest.raises(ValueError, match=r"1 video placeholder\(s\) \(<\|video_pad\|>\) but 0 video"):
        llm.generate(mm("<|im_start|>user <|vision_start|><|video_pad|><|vision_end|> hi", []), greedy(2))
    assert llm.generate(mm(prompt("what is this"), []), greedy(2))[0].finished  # still serving


def test_a_state_that_does_not_fit_is_refused_by_name(hybrid):
    path, _ = hybrid
    with pytest.raises(ValueError, match="recurrent state takes 58368 bytes"):
        engine(path, "torch", kv_cache_memory_bytes=64 * 1024)


def test_a_conversation_about_one_image_picks_up_where_the_last_turn_left(hybrid):
    path, ref = hybrid
    llm = engine(path, "torch", **memory(60, 4, 4))
    image = {"type": "image_url", "image_url": {"url": data_url(image_bytes(5, size=(100, 60)))}}
    turns = [[{"role": "user", "content": [image, {"type": "text", "text": "what is this"}]}]]
    first = llm.chat(turns[0], greedy(6))[0]
    second_turn = [*turns[0], {"role": "assistant", "content": first.outputs[0].text},
                   {"role": "user", "content": "and the colour"}]  # fmt: skip
    second = llm.chat(second_turn, greedy(6))[0]
    cut = (len(first.prompt_token_ids) - 1) // 8 * 8  # the last block boundary before its last token
    assert second.prompt_token_ids[:cut] == first.prompt_token_ids[:cut]
    assert second.num_cached_tokens == cut  # the image and the first question are not computed again
    assert second.outputs[0].token_ids == ref.generate(second.prompt, [make_image(5, (100, 60))], 6)
    state = llm.kv_report()["state"]
    assert state["snapshots_restored"] == 1 and state["snapshots"] > 0
    assert_no_state_held(llm)
    assert_all_free(llm)


def test_the_samples_of_one_prompt_start_from_its_state_before_the_last_token(hybrid):
    path, ref = hybrid
    # A step holds the whole prompt (20 tokens): the later samples wait for it, then take its full
    # blocks and a copy of its partial one, and the state from just before its last token.
    llm = engine(path, "torch", max_num_batched_tokens=32, **memory(60, 4, 4))
    text, imgs, _ = CASES[0]
    outs = llm.generate(mm(text, imgs), SamplingParams(temperature=0.0, max_tokens=6, n=3))[0].outputs
    want = ref.generate(text, imgs, 6)
    assert [o.token_ids for o in outs] == [want] * 3
    report = llm.kv_report()
    assert report["state"]["snapshots_restored"] == 2  # the two later samples
    assert sum(report[p]["partial_block_copies"] for p in ("text", "image")) == 2
    assert_no_state_held(llm)
    assert_all_free(llm)


def test_snapshots_go_with_their_blocks(hybrid):
    path, ref = hybrid
    # Room for one prompt's blocks at a time: each new prompt evicts the last one's cached blocks,
    # and with them the snapshots keyed by those blocks.
    llm = engine(path, "torch", **memory(12, 2, 2))
    for text, imgs, n in CASES[:3]:
        assert llm.generate(mm(text, imgs), greedy(n))[0].outputs[0].token_ids == ref.generate(text, imgs, n)
    report = llm.kv_report()
    blocks = llm.engine.core.blocks
    live = [k for k in blocks.snapshots._published if not blocks._alive(k)]
    assert live == []  # every snapshot kept names a block still cached
    assert report["state"]["snapshots"] <= 2
    assert_all_free(llm)


def test_async_scheduling_with_snapshots_matches_transformers(hybrid):
    """Overlapped steps: a snapshot is offered when its step settles, before its forward has run;
    a request that reuses it copies it in a later forward, which runs after (stream order)."""
    path, ref = hybrid
    llm = engine(path, "torch", async_scheduling=True, **memory(60, 4, 4))
    again = (prompt("what colour is it", 1), CASES[0][1], 6)  # the first case's image again
    batch = [*CASES, again]
    outs = llm.generate([mm(p, i) for p, i, _ in batch], [greedy(n) for *_, n in batch])
    for out, (text, imgs, n) in zip(outs, batch, strict=True):
        assert out.outputs[0].token_ids == ref.generate(text, imgs, n), text
    assert llm.engine.core.launcher is not None  # the overlapped loop (on a CPU: a launcher thread)
    assert outs[-1].num_cached_tokens > 0  # the image's prefix, from a snapshot
    assert_no_state_held(llm)
    assert_all_free(llm)
