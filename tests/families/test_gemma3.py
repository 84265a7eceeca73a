"""Gemma 3: an image's tokens attend to each other in both directions during prefill, local layers
attend within a sliding window. Greedy tokens equal to transformers' `generate` on a tiny random
checkpoint (block size 8, a step budget of 16 tokens, prompts longer than the 24-token window),
images never split across prefill chunks, a decode in the same step as another request's image
prefill, the masks of the torch path against a dense reference, processing equal to transformers'."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.families import assert_all_free, engine, family_prompt, greedy, mm
from helpers.images import make_image

LONG = " ".join(["what is this picture"] * 8)  # 32 words: longer than the sliding window


def prompt(question: str, n_images: int = 0) -> str:
    return family_prompt("gemma3", question, n_images)


BATCH = [
    (prompt("what is this", 1), [make_image(1, (70, 45))], 10),
    (
        prompt(f"{LONG} <start_of_image> and <start_of_image> which is left"),
        [make_image(2), make_image(3)],
        12,
    ),
    (prompt(f"{LONG} how many shapes are there"), [], 30),  # decodes past the window too
    (prompt("describe the picture", 1), [make_image(4, (40, 90))], 12),
]


@pytest.fixture(scope="module")
def gemma(vl_family):
    return vl_family("gemma3")


def _watch_chunks(llm) -> list:
    """Record every step's (request, start, tokens) as the runner prepares it (both the plain
    step and async scheduling, CUDA's default, prepare every batch)."""
    steps, prepare = [], llm.engine.core.runner.prepare

    def watched(batch, *args):
        steps.append([(req, req.num_computed_tokens, n) for req, n in batch.items])
        return prepare(batch, *args)

    llm.engine.core.runner.prepare = watched
    return steps


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_mixed_batch_matches_transformers_and_never_splits_an_image(gemma, backend, monkeypatch):
    if backend == "triton":
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    path, ref = gemma
    llm = engine(path, backend)
    steps = _watch_chunks(llm)
    outs = llm.generate([mm(p, imgs) for p, imgs, _ in BATCH], [greedy(n) for *_, n in BATCH])
    for out, (text, imgs, n) in zip(outs, BATCH, strict=True):
        assert out.prompt_token_ids == ref.inputs(text, imgs)["input_ids"][0].tolist()
        assert out.outputs[0].token_ids == ref.generate(text, imgs, n), text
    assert max(len(o.prompt_token_ids) for o in outs) > 2 * 24
    for step in steps:
        for req, start, n in step:
            for span in req.images:
                for lo, hi in span.embed_runs():
                    assert not lo < start + n < hi, "an image was split"
    assert any(n > 1 for step in steps for _, _, n in step)


def test_a_decode_runs_beside_another_requests_image_prefill(gemma):
    path, ref = gemma
    llm = engine(path, "torch", max_num_batched_tokens=24)
    steps = _watch_chunks(llm)
    cases = [(prompt("how many"), [], 20), (prompt(f"{LONG} what is this", 1), [make_image(5)], 6)]
    eng, done = llm.engine, {}
    # Ranked above the image request (lower is first), so its decodes keep their seat.
    eng.add_request(mm(*cases[0][:2]), greedy(cases[0][2]), request_id="text", priority=-1)
    eng.step()  # the text request is decoding before the image request arrives
    eng.add_request(mm(*cases[1][:2]), greedy(cases[1][2]), request_id="image")
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    for rid, (text, imgs, n) in zip(("text", "image"), cases, strict=True):
        assert done[rid].outputs[0].token_ids == ref.generate(text, imgs, n)

    def prefills_an_image(req, start, n):
        return any(start <= s.offset and s.offset + s.length <= start + n for s in req.images)

    assert any(
        any(n == 1 and req.num_prompt_tokens <= start for req, start, n in step)
        and any(prefills_an_image(*item) for item in step)
        for step in steps
    )


def test_an_image_longer_than_a_step_is_refused_by_name(gemma):
    path, _ = gemma
    llm = engine(path, "torch", max_num_batched_tokens=3)  # the image: a run of 4 soft tokens
    with pytest.raises(ValueError, match="max_num_batched_tokens=3"):
        llm.generate(mm(prompt("what", 1), [make_image(1)]), greedy(2))
    assert llm.generate(prompt("what is this"), greedy(2))[0].finished


def test_c_prefill_kernel_takes_the_masks(cpu_kernels):
    """The cpu backend's C prefill kernel (every ISA variant this CPU runs), decodes included,
    with bidirectional ranges and a window: the same as the torch path's masks."""
    test_masked_attention_equals_a_dense_reference("cpu", cpu_kernels)


@pytest.mark.parametrize("path", ["torch", "triton", "triton-split"])
def test_masked_attention_equals_a_dense_reference(path, kernels=None):
    """Each attention path's masks (causal, bidirectional ranges, sliding window) on a paged cache
    against SDPA over the same K/V laid out densely. Triton runs under its interpreter here (on a
    GPU with MM_ENGINE_TEST_DEVICE=cuda it runs compiled); "triton-split" is its split-KV path."""
    from helpers.device import TEST_DEVICE
    from mm_engine.kernels.metadata import AttentionMetadata
    from mm_engine.kernels.torch_backend import TorchBackend

    if path.startswith("triton") and TEST_DEVICE.type == "cpu":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip(
                "needs the Triton interpreter (TRITON_INTERPRET=1) or a GPU (MM_ENGINE_TEST_DEVICE=cuda)"
            )

    g = torch.Generator().manual_seed(0)
    bs, kvh, h, d = 4, 2, 4, 16
    seqs = [(12, 7), (9, 1), (20, 20)]  # (length, new tokens)
    ranges = {0: (6, 10), 2: (3, 8)}  # a sequence's image positions [lo, hi)
    blocks = [list(range(0, 3)), list(range(3, 6)), list(range(6, 11))]
    k_cache = torch.randn(11, bs, kvh, d, generator=g)
    v_cache = torch.randn(11, bs, kvh, d, generator=g)
    q_lens = [n for _, n in seqs]
    query = torch.randn(sum(q_lens), h, d, generator=g)
    lo, hi = torch.zeros(len(query), dtype=torch.long), torch.zeros(len(query), dtype=torch.long)
    row = 0
    for i, (length, n) in enumerate(seqs):
        for p in range(length - n, length):
            if i in ranges and ranges[i][0] <= p < ranges[i][1]:
                lo[row], hi[row] = ranges[i]
            row += 1
    width = max(len(b) for b in blocks)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, *q_lens]).cumsum(0).int(),
        seq_lens=torch.tensor([s for s, _ in seqs]).int(),
        block_tables=torch.tensor([b + [0] * (width - len(b)) for b in blocks]).int(),
        slot_mapping=torch.zeros(len(query), dtype=torch.long),
        max_query_len=max(q_lens),
        max_seq_len=max(s for s, _ in seqs),
        query_lens_cpu=q_lens,
        seq_lens_cpu=[s for s, _ in seqs],
        bidirectional=(lo, hi),
    )
    for window in (None, 5):
        if path in ("torch", "cpu"):
            backend = TorchBackend(kernels)
            assert backend.c_prefill == (path == "cpu")
            if path == "cpu":  # the kernel must answer, not the torch path behind it
                backend._masked = lambda *args: pytest.fail("the C prefill kernel declined the masks")
            got = backend.attend(query, k_cache, v_cache, meta, 0.25, window=window)
        else:
            from mm_engine.kernels.triton_attention import paged_attention

            dev = TEST_DEVICE
            moved = AttentionMetadata(
                **{f: getattr(meta, f).to(dev) for f in ("query_start_loc", "seq_lens", "block_tables")},
                slot_mapping=meta.slot_mapping.to(dev),
                max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
                query_lens_cpu=meta.query_lens_cpu, seq_lens_cpu=meta.seq_lens_cpu,
                bidirectional=tuple(t.to(dev) for t in meta.bidirectional),
            )  # fmt: skip
            splits = 2 if path == "triton-split" else 1
            got = paged_attention(
                query.to(dev), k_cache.to(dev), v_cache.to(dev), moved, 0.25, num_splits=splits, window=window
            ).cpu()
        row = 0
        for i, (length, n) in enumerate(seqs):
            k = k_cache[blocks[i]].reshape(-1, kvh, d)[:length].transpose(0, 1)
            v = v_cache[blocks[i]].reshape(-1, kvh, d)[:length].transpose(0, 1)
            mask = torch.zeros(n, length, dtype=torch.bool)
            for j, p in enumerate(range(length - n, length)):
                for key in range(length):
                    seen = key <= p or (
                        i in ranges
                        and ranges[i][0] <= p < ranges[i][1]
                        and ranges[i][0] <= key < ranges[i][1]
                    )
                    mask[j, key] = seen and (window is None or key > p - window)
            q = query[row : row + n].transpose(0, 1)
            want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
            torch.testing.assert_close(got[row : row + n], want.transpose(0, 1))
            row += n


@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA", "P"])
def test_processing_equals_the_hf_processor(gemma, mode):
    path, ref = gemma
    llm = engine(path, "torch")
    images = [make_image(30 + i, s).convert(mode) for i, s in enumerate([(70, 45), (13, 100), (9, 9)])]
    text = prompt("what is this", len(images))
    _, ids, spans = llm.engine.inputs.process(mm(text, images))
    want = ref.inputs(text, images)
    assert ids == want["input_ids"][0].tolist()
    torch.testing.assert_close(torch.cat([s.pixel_values for s in spans]), want["pixel_values"])
    assert [s.embed_mask.count(True) for s in spans] == [4, 4, 4]


def test_pan_and_scan_crops_match_transformers(gemma):
    """Each crop its own bidirectional run after the original image's; per server and per request."""
    path, ref = gemma
    options = {
        "do_pan_and_scan": True,
        "pan_and_scan_min_crop_size": 8,
        "pan_and_scan_min_ratio_to_activate": 1.2,
    }
    wide, square = make_image(11, (160, 40)), make_image(12, (40, 40))
    cases = [(prompt("what is this", 1), [wide], 8), (prompt("and this", 1), [square], 6)]
    llm = engine(path, "torch", mm_processor_kwargs=options)
    outs = llm.generate([mm(p, i) for p, i, _ in cases], [greedy(n) for *_, n in cases])
    for out, (text, imgs, n) in zip(outs, cases, strict=True):
        assert out.prompt_token_ids == ref.inputs(text, imgs, **options)["input_ids"][0].tolist()
        assert out.outputs[0].token_ids == ref.generate(text, imgs, n, **options)
    _, _, spans = llm.engine.inputs.process(mm(cases[0][0], [wide]))
    assert spans[0].pixel_values.shape[0] > 1 and spans[0].num_embeds == 4 * spans[0].pixel_values.shape[0]
    plain = engine(path, "torch")
    per_request = plain.generate({**mm(cases[0][0], [wide]), "mm_processor_kwargs": options}, greedy(8))[0]
    assert per_request.outputs[0].token_ids == outs[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="unknown mm_processor_kwargs option 'max_pixels'"):
        engine(path, mm_processor_kwargs={"max_pixels": 4})


def test_preemption_recomputes_images_whole(gemma):
    path, ref = gemma
    # 4 layers x 2 KV heads x head 32 x 8 slots x K and V x 4 bytes = 16 KiB a block; 20 blocks.
    llm = engine(path, "torch", kv_cache_memory_bytes=20 * 16384, image_pool_fraction=0.2)
    batch = BATCH[:2] + BATCH[3:]
    outs = llm.generate([mm(p, imgs) for p, imgs, _ in batch * 2], [greedy(n) for *_, n in batch * 2])
    assert llm.engine.core.scheduler.num_preemptions > 0
    for out, (text, imgs, n) in zip(outs, batch * 2, strict=True):
        assert out.outputs[0].token_ids == ref.generate(text, imgs, n), text


@pytest.mark.slow
@pytest.mark.subprocess
def test_two_tensor_parallel_ranks_equal_transformers(gemma):
    """Gemma's own layers split over 2 ranks (heads, MLP width, the scaled vocabulary-parallel
    embedding), its images encoded over both: the sliding window and the bidirectional image
    spans hold on each rank's heads."""
    path, ref = gemma
    llm = engine(path, tensor_parallel_size=2, max_num_batched_tokens=128)  # several images a step
    try:
        outs = llm.generate([mm(p, imgs) for p, imgs, _ in BATCH], [greedy(n) for *_, n in BATCH])
        for out, (text, imgs, n) in zip(outs, BATCH, strict=True):
            assert out.outputs[0].token_ids == ref.generate(text, imgs, n), text
        assert llm.engine.core.runner.encoder.images_per_rank[1] > 0
        assert_all_free(llm)
    finally:
        llm.close()
