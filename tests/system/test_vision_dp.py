"""The data-parallel vision tower under tensor parallelism (`mm_encoder_tp_mode="data"`): a step's
images split over the ranks by pixels, each rank encoding its share, the features gathered on
rank 0; greedy tokens equal TP=1's for LLaVA in both modes, also while a forward is in flight, and
a share that fails to encode fails only its batch. (Every family's images over the ranks, and a
worker that dies before an encode: tests/system/test_tensor_parallel.py.)"""

from __future__ import annotations

import pytest
import torch

from helpers.images import make_image
from mm_engine import LLM, SamplingParams
from mm_engine.core.faults import StepFailedError
from mm_engine.parallel.vision_dp import DataParallelEncoder, split_images
from mm_engine.request import ImageSpan

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

WIDE = dict(kv_cache_memory_bytes=8 * 1024**2, block_size=8, max_num_batched_tokens=512)


def _span(pixels: int) -> ImageSpan:
    return ImageSpan(0, 1, torch.zeros(pixels), "")


def test_images_split_by_pixels_each_once():
    images = [_span(n) for n in (10, 40, 20, 30, 5)]
    shares = split_images(images, 2)
    assert sorted(i for s in shares for i in s) == list(range(5))
    loads = [sum(images[i].pixel_values.numel() for i in s) for s in shares]
    assert loads == [50, 55] or loads == [55, 50]
    assert all(s == sorted(s) for s in shares)  # in prompt order within a share
    assert split_images(images[:1], 3) == [[0], [], []]


def _prompts() -> list:
    ask = "USER: <image> <image> describe both ASSISTANT:"
    return [
        {"prompt": ask, "multi_modal_data": {"image": [make_image(1), make_image(2)]}},
        {"prompt": ask, "multi_modal_data": {"image": [make_image(3), make_image(1)]}},
        {"prompt": "USER: <image> what is this ASSISTANT:", "multi_modal_data": {"image": [make_image(4)]}},
        "USER: what is red ASSISTANT:",
    ]


def _tokens(llm: LLM, n: int = 12) -> list[list[int]]:
    outs = llm.generate(_prompts(), SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("mode", ["data", "rank0"])
def test_llava_images_encoded_over_the_ranks_equal_tp1(clip_llama, mode):
    expected = _tokens(LLM(clip_llama, **WIDE))
    llm = LLM(clip_llama, tensor_parallel_size=2, mm_encoder_tp_mode=mode, **WIDE)
    try:
        assert _tokens(llm) == expected
        encoder = llm.engine.core.runner.encoder
        if mode == "data":  # four distinct images in the first step: two on each rank
            assert isinstance(encoder, DataParallelEncoder) and encoder.images_per_rank == [2, 2]
        else:
            assert not isinstance(encoder, DataParallelEncoder)
        assert llm.engine.core.runner.num_encoded_images == 4
    finally:
        llm.close()


def test_an_encode_beside_a_launched_forward_takes_its_turn(clip_llama):
    """With the thread launcher a forward runs while the host prepares the next step: images that
    arrive then are encoded over the ranks in turn with it, and the tokens are the plain engine's.
    (On a CPU the step's tensors go through shared memory and the encode's through gloo, so this
    would pass without the turn too; on CUDA both share one NCCL communicator.)"""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    plain = LLM(clip_llama, **WIDE)
    expected = [list(o.outputs[0].token_ids) for o in plain.generate(_prompts(), params)]
    llm = LLM(clip_llama, tensor_parallel_size=2, async_scheduling=True, async_launch="thread", **WIDE)
    try:
        engine, finals = llm.engine, {}
        prompts = _prompts()
        engine.add_request(prompts[3], params, request_id="3")
        for _ in range(3):  # the text request decodes, a forward always in flight
            finals.update({o.request_id: o for o in engine.step() if o.finished})
        for i in range(3):
            engine.add_request(prompts[i], params, request_id=str(i))
        while engine.has_unfinished():
            finals.update({o.request_id: o for o in engine.step() if o.finished})
        assert [list(finals[str(i)].outputs[0].token_ids) for i in range(4)] == expected
        assert engine.core.runner.encoder.images_per_rank == [2, 2]
    finally:
        llm.close()


def test_a_share_that_fails_to_encode_fails_its_batch_and_the_ranks_go_on(clip_llama):
    """Rank 0's own share raises (as a worker's would): every rank still joins the gathers, the
    batch fails like any failed encode (no device fault), and the next batch runs over both ranks."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [list(o.outputs[0].token_ids) for o in LLM(clip_llama, **WIDE).generate(_prompts(), params)]
    llm = LLM(clip_llama, tensor_parallel_size=2, **WIDE)
    try:
        engine, model = llm.engine, llm.engine.core.model
        encode = model.encode

        def fails_once(images):
            model.encode = encode
            raise ValueError("this share cannot be encoded")

        model.encode = fails_once
        engine.add_request(_prompts()[0], params, request_id="doomed")
        with pytest.raises(StepFailedError) as info:
            engine.step()
        assert not info.value.device_lost and info.value.request_ids == ["doomed"]
        assert all(pool.num_used == 0 for pool in engine.core.blocks.pools.values())
        outs = llm.generate(_prompts(), params)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
        assert engine.core.runner.encoder.images_per_rank == [1 + 2, 1 + 2]  # the failed step, then the batch
    finally:
        llm.close()
