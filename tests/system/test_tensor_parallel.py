"""Tensor parallelism on CPU: TP=2 (rank 0 and one worker process, on the 2 cores) gives the greedy
tokens of TP=1 for LLaVA and transformers' for the other families, through chunked prefill, prefix reuse
with the partial-block copy, preemption (recompute and swap), async scheduling and an abort; a
split the model cannot take is refused before any worker starts; a worker that dies stops the
engine with a device fault, at once, instead of a hang."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.families import family_prompt, greedy, mm
from helpers.images import make_image
from mm_engine import LLM, SamplingParams
from mm_engine.core.faults import StepFailedError

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

TIGHT = dict(block_size=8, image_pool_fraction=0.4, max_num_batched_tokens=16)
KV = 16 * 1024 * 20  # 20 blocks at TP=1; the same 20 blocks at TP=2 in half the bytes per rank


def _prompts() -> list:
    scene = {"image": [make_image(5)]}
    return [
        {"prompt": "USER: <image> describe the picture in many words ASSISTANT:", "multi_modal_data": scene},
        {"prompt": "USER: <image> describe the picture in many words ASSISTANT:", "multi_modal_data": scene},
        "USER: what is red and what is blue ASSISTANT:",
        {"prompt": "USER: <image> what is this ASSISTANT:", "multi_modal_data": {"image": [make_image(6)]}},
    ]


def _tokens(llm: LLM, prompts, n: int = 20) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def test_llava_tp2_equals_tp1_through_chunks_reuse_and_preemption(clip_llama):
    plain = LLM(clip_llama, kv_cache_memory_bytes=KV, **TIGHT)
    expected = _tokens(plain, _prompts())
    assert plain.kv_report()["text"]["preemptions"] + plain.kv_report()["image"]["preemptions"] > 0
    threads = torch.get_num_threads()
    llm = LLM(clip_llama, tensor_parallel_size=2, kv_cache_memory_bytes=KV // 2, **TIGHT)
    try:
        assert _tokens(llm, _prompts()) == expected
        # Rank 0 computes with its share of the cores, and the caller's thread keeps its own count.
        assert llm.engine.core.runner.threads == max(1, threads // 2)
        assert torch.get_num_threads() == threads
        report = llm.kv_report()
        assert report["text"]["preemptions"] + report["image"]["preemptions"] > 0  # tight pools: recompute
        assert report["image"]["prefix_cache_hits"] + report["text"]["partial_block_copies"] > 0
        assert report["text"]["used_blocks"] == report["image"]["used_blocks"] == 0
    finally:
        llm.close()


def test_qwen2_vl_tp2_equals_transformers_and_survives_an_abort(vl_family):
    path, ref = vl_family("qwen2_vl")
    cases = [(family_prompt("qwen2_vl", "describe", 1), [make_image(3, (40, 60))], 8),
             (family_prompt("qwen2_vl", "hello there", 0), [], 6)]  # fmt: skip
    llm = LLM(path, tensor_parallel_size=2, kv_cache_memory_bytes=8 * 1024**2, block_size=8,
              max_num_batched_tokens=16)  # fmt: skip
    try:
        outs = llm.generate([mm(p, imgs) for p, imgs, _ in cases], [greedy(n) for *_, n in cases])
        for out, (text, imgs, n) in zip(outs, cases, strict=True):
            assert out.outputs[0].token_ids == ref.generate(text, imgs, n)
        engine = llm.engine
        engine.add_request(mm(*cases[0][:2]), greedy(30), request_id="gone")
        engine.add_request(mm(*cases[1][:2]), greedy(6), request_id="kept")
        finals, step = {}, 0
        while engine.has_unfinished():
            if step == 3:
                engine.abort("gone")
            finals.update({o.request_id: o for o in engine.step() if o.finished})
            step += 1
        assert (
            list(finals) == ["kept"] and finals["kept"].outputs[0].token_ids == outs[1].outputs[0].token_ids
        )
        assert all(pool.num_used == 0 for pool in engine.core.blocks.pools.values())
    finally:
        llm.close()


def test_a_split_the_model_cannot_take_is_refused_before_any_worker(siglip_qwen2, clip_llama):
    with pytest.raises(ValueError, match="tensor_parallel_size 2 does not divide .*num_key_value_heads"):
        LLM(siglip_qwen2, tensor_parallel_size=2)  # one KV head
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide"):
        LLM(clip_llama, tensor_parallel_size=3)


TWO_IMAGES = {"prompt": "USER: <image> <image> both ASSISTANT:",
              "multi_modal_data": {"image": [make_image(1), make_image(2)]}}  # fmt: skip


@pytest.mark.parametrize("then", [None, TWO_IMAGES], ids=["mid-decode", "before-an-encode"])
def test_a_worker_that_dies_stops_the_engine_without_a_hang(clip_llama, then):
    """Killed between two decodes, or before a step whose images it would encode a share of."""
    kw = dict(kv_cache_memory_bytes=8 * 1024**2, max_num_batched_tokens=512)
    llm = LLM(clip_llama, tensor_parallel_size=2, **kw)
    try:
        engine = llm.engine
        engine.add_request("USER: what is red ASSISTANT:", SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        worker = engine.core.parallel._procs[0]
        worker.kill()
        worker.wait()
        if then is not None:
            engine.add_request(then, SamplingParams(max_tokens=4))
        with pytest.raises(StepFailedError) as info:
            while engine.has_unfinished():
                engine.step()
        assert info.value.device_lost
        assert all(pool.num_used == 0 for pool in engine.core.blocks.pools.values())
    finally:
        llm.close()


def test_rank0_failing_inside_a_forward_stops_the_group_at_once(clip_llama):
    """Out of memory in rank 0's second layer, say: the worker waits in a collective that will
    never come, and the next step's would pair with it (wrong tokens, silently). So it is a device
    fault: the workers stop at once, every block is freed, and closing does not wait for them."""
    llm = LLM(clip_llama, tensor_parallel_size=2, kv_cache_memory_bytes=8 * 1024**2)
    try:
        engine = llm.engine
        engine.add_request("USER: what is red ASSISTANT:", SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        mlp = engine.core.model.language_model.layers[1].mlp

        def out_of_memory(x):
            raise torch.OutOfMemoryError("no memory for the MLP")

        mlp.forward = out_of_memory
        with pytest.raises(StepFailedError) as info:
            engine.step()
        assert info.value.device_lost
        assert all(proc.poll() is not None for proc in engine.core.parallel._procs)
        assert all(pool.num_used == 0 for pool in engine.core.blocks.pools.values())
    finally:
        llm.close()


def test_it_composes_with_the_core_process_and_data_parallelism(clip_llama):
    import asyncio

    from mm_engine.engine.async_client import AsyncMPLLM

    kw = dict(kv_cache_memory_bytes=4 * 1024**2, block_size=8)
    prompts = ["USER: what is red ASSISTANT:", "USER: what is blue and green ASSISTANT:"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(clip_llama, **kw).generate(prompts, params)]
    # Two engine-core processes, each rank 0 of its own pair (the sync client's core process is
    # the same process, so this covers `LLM(..., multiprocess=True)` too).
    llm = AsyncMPLLM.from_engine_args(clip_llama, data_parallel_size=2, tensor_parallel_size=2, **kw)

    async def run(prompt: str, rid: str) -> list[int]:
        inputs = await llm.process_prompt(prompt)
        outs = [out async for out in llm.generate(inputs, params, request_id=rid)]
        return outs[-1].outputs[0].token_ids

    async def both() -> tuple[list, set]:
        try:
            got = await asyncio.gather(*(run(p, f"r{k}") for k, p in enumerate(prompts)))
            return got, {len(s["per_core"]) for s in [llm.stats()]}
        finally:
            await llm.shutdown()

    got, cores = asyncio.run(both())
    assert got == expected and cores == {2}  # two cores, each over two ranks


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_parallel_path_at_size_one_equals_the_plain_engine(clip_llama, device):
    """`tensor_parallel_always`: the sharded layers, the wire and the group (gloo; NCCL on CUDA)
    with one rank, against the engine without them."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device here (bench/gpu_checks.sh runs this on a GPU)")
    kw = dict(device=device, kv_cache_memory_bytes=8 * 1024**2, block_size=8)
    expected = _tokens(LLM(clip_llama, **kw), _prompts())
    llm = LLM(clip_llama, tensor_parallel_always=True, **kw)
    try:
        assert llm.engine.core.parallel is not None and llm.engine.core.parallel.group.world == 1
        assert _tokens(llm, _prompts()) == expected
    finally:
        llm.close()


def test_a_worker_keeps_only_its_language_model(vl_family):
    from mm_engine import models
    from mm_engine.models.loader import load_config
    from mm_engine.models.platform import make_platform
    from mm_engine.parallel.worker import drop_vision

    path, _ = vl_family("qwen2_vl")
    cpu = torch.device("cpu")
    model = models.load_model(Path(path), load_config(Path(path)), torch.float32, torch.float32, cpu,
                              make_platform(cpu, "torch"))  # fmt: skip
    assert any(not n.startswith("language_model.") for n, _ in model.named_parameters())
    drop_vision(model)
    assert all(n.startswith("language_model.") for n, _ in model.named_parameters())


@pytest.mark.parametrize("mode", ["inline", "thread"])
def test_async_scheduling_over_the_ranks(clip_llama, mode):
    """A decode whose input is the previous step's token still on the device: the workers get
    those tokens with the step (in the forward's order), so async scheduling composes with TP."""
    kw = dict(kv_cache_memory_bytes=8 * 1024**2, block_size=8)
    expected = _tokens(LLM(clip_llama, **kw), _prompts())
    llm = LLM(clip_llama, tensor_parallel_size=2, async_scheduling=True, async_launch=mode, **kw)
    try:
        assert llm.engine.core.launcher is not None
        assert _tokens(llm, _prompts()) == expected
        assert llm.engine.core.runner.encoder.images_per_rank == [1, 1]  # an encode beside the launches
    finally:
        llm.close()


def test_swap_preemption_over_the_ranks(clip_llama):
    """Each worker repeats rank 0's swaps on its own KV heads (out, in, dropped)."""
    kw = dict(preemption_mode="swap", **TIGHT)
    plain = LLM(clip_llama, kv_cache_memory_bytes=KV, **kw)
    expected = _tokens(plain, _prompts())
    assert plain.kv_report()["swap"]["swapped_in_blocks"] > 0
    llm = LLM(clip_llama, tensor_parallel_size=2, kv_cache_memory_bytes=KV // 2, **kw)
    try:
        assert _tokens(llm, _prompts()) == expected
        report = llm.kv_report()
        assert report["swap"]["swapped_in_blocks"] == plain.kv_report()["swap"]["swapped_in_blocks"]
        assert report["swap"]["host_bytes_used"] == 0
    finally:
        llm.close()


# One family per language-model and connector path: Qwen2-VL (M-RoPE, image grids), Qwen3-VL
# (DeepStack, q/k norms, interleaved M-RoPE), Qwen3-VL-MoE (each expert's width split), Qwen3.5-MoE
# (linear-attention heads and their state split, gated attention, the shared expert), Idefics3
# (padded crops with a pixel mask), InternVL (pixel shuffle, the tower/projector layout), Mistral 3
# (patch merger), LLaVA-OneVision (anyres packing, Qwen2's biases), GLM-4.1V (sandwich norms, the
# interleaved partial rotary, the fused gate_up split on load), GLM-4.5V (grouped sigmoid routing, shared
# experts split like the dense MLP), Gemma 4 (per-layer embeddings whole
# on every rank, KV-sharing layers, global heads of their own size), PaddleOCR-VL (its SigLIP tower and
# projector whole on every rank, ERNIE-4.5 with M-RoPE split). Their twins share these paths:
# Qwen2.5-VL, SmolVLM, InternVL-Qwen3, LLaVA-NeXT, GLM-4.6V, GLM-OCR. LLaVA is above, Gemma 3 in
# tests/families/test_gemma3.py.
@pytest.mark.parametrize(
    "family",
    [
        "qwen2_vl",
        "qwen3_vl",
        "qwen3_vl_moe",
        "qwen3_5_moe",
        "idefics3",
        "internvl",
        "mistral3",
        "lighton_ocr",
        "llava_onevision",
        "glm4v",
        "glm4v_moe",
        "gemma4",
        "paddleocr_vl",
    ],
)
def test_the_families_split_over_two_ranks(vl_family, family):
    """TP=2 against transformers, two images in one step so that the worker encodes a share."""
    path, ref = vl_family(family)
    two = [make_image(3, (40, 60)), make_image(4, (64, 32))]  # of different sizes (grids, masks)
    cases = [(family_prompt(family, "describe both", 2), two, 6),
             (family_prompt(family, "hello there", 0), [], 6)]  # fmt: skip
    llm = LLM(path, tensor_parallel_size=2, kv_cache_memory_bytes=8 * 1024**2, max_num_batched_tokens=512)
    try:
        outs = llm.generate([mm(p, imgs) for p, imgs, _ in cases], [greedy(n) for *_, n in cases])
        for out, (text, imgs, n) in zip(outs, cases, strict=True):
            assert out.outputs[0].token_ids == ref.generate(text, imgs, n)
        assert llm.engine.core.runner.encoder.images_per_rank[1] > 0
    finally:
        llm.close()


def test_gemma4_moe_over_two_ranks(tmp_path):
    """Gemma 4's 26B-A4B line at TP=2 (two global KV heads so they split): each expert's width and
    the dense MLP split, the router whole, images kept whole in a step as they attend both ways."""
    from helpers.reference import FamilyReference
    from mm_engine.testing import build_checkpoint

    path = str(build_checkpoint("gemma4_moe", tmp_path / "g", text_dims={"num_global_key_value_heads": 2}))
    ref = FamilyReference(path)
    two = [make_image(3, (40, 60)), make_image(4, (64, 32))]
    cases = [(family_prompt("gemma4", "describe both", 2), two, 6),
             (family_prompt("gemma4", "hello there", 0), [], 6)]  # fmt: skip
    llm = LLM(path, tensor_parallel_size=2, kv_cache_memory_bytes=8 * 1024**2, max_num_batched_tokens=512)
    try:
        outs = llm.generate([mm(p, imgs) for p, imgs, _ in cases], [greedy(n) for *_, n in cases])
        for out, (text, imgs, n) in zip(outs, cases, strict=True):
            assert out.outputs[0].token_ids == ref.generate(text, imgs, n)
    finally:
        llm.close()


def test_a_hybrid_model_over_two_ranks_through_chunks_reuse_and_swap(vl_family):
    """Qwen3.5 at TP=2: each rank holds its heads of the recurrent state; prefill chunks continue
    from it, a swapped request's state goes to host and back on every rank, and the repeated
    prompts restore snapshots (copied on every rank)."""
    path, ref = vl_family("qwen3_5")
    cases = [
        (family_prompt("qwen3_5", "what is this", 1), [make_image(1, (70, 45))], 9),
        (
            family_prompt("qwen3_5", "which is left", 2),
            [make_image(2, (120, 100)), make_image(3, (30, 64))],
            7,
        ),
        (family_prompt("qwen3_5", "how many shapes are there", 0), [], 8),
        (family_prompt("qwen3_5", "describe the picture", 1), [make_image(4, (40, 90))], 10),
    ] * 2
    # A rank's share: a slot is 3 layers x (conv 128 x 3 + state 2 x 32 x 32) floats, a block one
    # layer's K and V of one KV head; 24 blocks, 8 slots and 8 snapshot rows.
    slot, block = 3 * (128 * 3 + 2 * 32 * 32) * 4, 2 * 8 * 1 * 32 * 4
    total = 24 * block + 16 * slot
    llm = LLM(
        path, tensor_parallel_size=2, block_size=8, max_num_batched_tokens=16, preemption_mode="swap",
        image_pool_fraction=0.3, kv_cache_memory_bytes=total, num_state_snapshots=8,
        max_state_memory_fraction=(16 * slot + 1) / total,
    )  # fmt: skip
    try:
        outs = llm.generate([mm(p, i) for p, i, _ in cases], [greedy(n + 6) for *_, n in cases])
        for out, (text, imgs, n) in zip(outs, cases, strict=True):
            assert out.outputs[0].token_ids == ref.generate(text, imgs, n + 6), text
        report = llm.kv_report()
        assert report["swap"]["swapped_in_blocks"] > 0 and report["state"]["snapshots_restored"] > 0
        assert report["state"]["used"] == 0 and report["swap"]["host_bytes_used"] == 0
        assert report["text"]["used_blocks"] == report["image"]["used_blocks"] == 0
    finally:
        llm.close()


def test_quantized_weights_split_over_two_ranks(vl_family):
    """Each rank rounds its own shard: bf16 at TP=2 gives TP=1's tokens; int4 groups that a
    row-parallel shard cannot hold whole are refused by name."""
    path, _ = vl_family("qwen2_vl")
    cases = [
        mm(family_prompt("qwen2_vl", "describe", 1), [make_image(3, (40, 60))]),
        family_prompt("qwen2_vl", "hi", 0),
    ]
    kw = dict(quantization="bf16", kv_cache_memory_bytes=8 * 1024**2, max_num_batched_tokens=512)
    expected = _tokens(LLM(path, **kw), cases, 8)
    llm = LLM(path, tensor_parallel_size=2, **kw)
    try:
        assert _tokens(llm, cases, 8) == expected
    finally:
        llm.close()
    with pytest.raises(
        ValueError, match="quantization groups of 128 inputs do not fit o_proj.s shard of 64 under"
    ):
        LLM(path, tensor_parallel_size=2, **{**kw, "quantization": "int4"})


@pytest.mark.parametrize(
    ("family", "stored"),
    [("qwen3_5", "gptq"), ("qwen2_vl", "awq"), ("qwen2_vl", "fp8")],
)
def test_a_checkpoint_stored_quantized_splits_over_two_ranks_as_stored(vl_family, tmp_path, family, stored):
    """Each rank reads its share of the stored values, scales and zero points (nothing rounded
    again) and the two give the tokens transformers gives on the dequantized twin. Qwen3.5 with
    GPTQ: the linear attention's q | k | v projection cut in three; FP8: 128-wide blocks whose
    row-parallel shares are 64 wide."""
    from helpers.fp8 import fp8_checkpoint
    from helpers.gptq_awq import awq_checkpoint, gptq_checkpoint
    from helpers.reference import FamilyReference
    from mm_engine.models.layers.quant_linear import QuantLinear

    path, _ = vl_family(family)
    if stored == "gptq":
        packed, twin = gptq_checkpoint(path, tmp_path, bits=4, group=32, symmetric=False, act_order=None)
    elif stored == "awq":
        packed, twin = awq_checkpoint(path, tmp_path, group=32)
    else:
        packed, twin = fp8_checkpoint(path, tmp_path)
    ref = FamilyReference(twin)
    two = [make_image(3, (40, 60)), make_image(4, (64, 32))]
    cases = [
        (family_prompt(family, "describe both", 2), two, 6),
        (family_prompt(family, "hello there", 0), [], 6),
    ]
    llm = LLM(packed, tensor_parallel_size=2, kv_cache_memory_bytes=8 * 1024**2, block_size=8,
              max_num_batched_tokens=16)  # fmt: skip
    try:
        outs = llm.generate([mm(p, imgs) for p, imgs, _ in cases], [greedy(n) for *_, n in cases])
        for out, (text, imgs, n) in zip(outs, cases, strict=True):
            assert out.outputs[0].token_ids == ref.generate(text, imgs, n), text
        lm = llm.engine.core.model.language_model
        layers = [m for m in lm.modules() if isinstance(m, QuantLinear)]
        kind = "fp8" if stored == "fp8" else "int4"
        assert layers and {(m.kind, m.panels is not None) for m in layers} == {(kind, True)}
        if stored == "fp8":  # o_proj's 128 inputs, one block wide, split in two
            assert lm.layers[0].self_attn.o_proj.panels.group == 64
    finally:
        llm.close()


def test_a_checkpoint_in_act_order_is_refused_where_its_inputs_would_be_split(vl_family, tmp_path):
    from helpers.gptq_awq import gptq_checkpoint

    path, _ = vl_family("qwen2_vl")
    packed, _ = gptq_checkpoint(path, tmp_path, bits=4, group=32, symmetric=True, act_order="shared")
    with pytest.raises(ValueError, match=r"proj cannot be split over tensor_parallel_size 2: .*act-order"):
        LLM(packed, tensor_parallel_size=2, kv_cache_memory_bytes=8 * 1024**2)
