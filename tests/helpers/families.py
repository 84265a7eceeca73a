"""What the family tests share: an engine with small blocks and a step budget that splits image
runs across chunks, greedy sampling, multimodal prompts, and the no-leak check."""

from __future__ import annotations

import torch

from helpers.device import TEST_DEVICE
from mm_engine import LLM, SamplingParams

QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|> "
ALL_FAMILIES = [
    "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "idefics3", "smolvlm",
    "internvl", "internvl_qwen3", "mistral3", "lighton_ocr", "llava_next", "llava_onevision", "gemma3",
    "glm4v", "glm_ocr", "gemma4", "paddleocr_vl",
]  # fmt: skip


def family_prompt(family: str, question: str, n_images: int = 0) -> str:
    """A raw prompt in the family's format with `n_images` placeholders before the question."""
    if family.startswith("qwen"):
        return f"<|im_start|>user {QWEN_IMAGE * n_images}{question}<|im_end|> <|im_start|>assistant "
    if family == "lighton_ocr":
        return f"<|im_start|>user {'<|image_pad|> ' * n_images}{question}<|im_end|> <|im_start|>assistant "
    if family.startswith("internvl"):
        return f"<|im_start|>user {'<IMG_CONTEXT> ' * n_images}{question}<|im_end|> <|im_start|>assistant "
    if family == "mistral3":
        return f"<s>[INST]{'[IMG]' * n_images} {question}[/INST]"
    if family == "gemma3":
        images = "<start_of_image>" * n_images
        return f"<bos><start_of_turn>user\n{images} {question}<end_of_turn>\n<start_of_turn>model\n"
    if family.startswith("gemma4"):
        images = "<|image|>" * n_images
        return f"<bos><|turn>user\n{images} {question}<turn|>\n<|turn>model\n"
    if family == "paddleocr_vl":
        images = "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>" * n_images
        return f"<s>User: {images}{question}\nAssistant: "
    if family.startswith("glm"):
        images = "<|begin_of_image|><|image|><|end_of_image|> " * n_images
        return f"[gMASK]<sop><|user|> {images}{question} <|assistant|> "
    if family.startswith("llava"):
        return f"USER: {'<image> ' * n_images}{question} ASSISTANT:"
    return f"<|endoftext|>User:{'<image>' * n_images} {question}<end_of_utterance>\nAssistant:"


def mm(text: str, images: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


def engine(path: str, backend: str = "auto", **kwargs) -> LLM:
    args = dict(kv_cache_memory_bytes=8 * 1024**2, block_size=8, max_num_batched_tokens=16)
    if backend == "triton":  # interpreted on CPU tensors, or compiled on a GPU, in float32
        args.update(device=TEST_DEVICE.type, dtype="float32", vision_dtype="float32")
    elif backend in ("torch", "cpu"):  # the CPU paths, also on a machine with a GPU
        args.update(device="cpu")
    return LLM(path, attention_backend=backend, **{**args, **kwargs})


def assert_all_free(llm: LLM) -> None:
    report = llm.kv_report()
    for pool in ("text", "image"):
        assert report[pool]["used_blocks"] == 0
        assert report[pool]["free_blocks"] + report[pool]["cached_blocks"] == report[pool]["total_blocks"]


def assert_tower_and_positions(path: str, ref, cases: list[tuple[str, list, int]]) -> None:
    """For a Qwen-line model (image grids, M-RoPE): each case's prompt ids, pixel values, tower
    features and rotary positions equal to transformers' processor, `get_image_features` and
    `get_rope_index`."""
    llm = engine(path, "torch")
    model = llm.engine.core.model
    for text, imgs, _ in cases:
        if not imgs:
            continue
        _, ids, spans = llm.engine.inputs.process(mm(text, imgs))
        inputs = ref.inputs(text, imgs)
        assert ids == inputs["input_ids"][0].tolist()
        torch.testing.assert_close(torch.cat([s.pixel_values for s in spans]), inputs["pixel_values"])
        with torch.inference_mode():
            got = torch.cat([e[:, 0] for e in model.encode(spans)])
            want = ref.model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        want = torch.cat(list(want.pooler_output))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * max(1.0, want.abs().max().item()))
        mine = model.positions(ids, spans)
        positions, delta = ref.model.model.get_rope_index(
            input_ids=inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"],
            image_grid_thw=inputs["image_grid_thw"],
        )  # fmt: skip
        assert torch.equal(mine.prompt, positions[:, 0]) and mine.delta == int(delta)


def run_batch_against(ref, path: str, backend: str, cases: list[tuple[str, list, int]], **kwargs) -> list:
    """Run `(prompt, images, max tokens)` cases as one batch on `backend`; every prompt's ids and
    greedy tokens must equal transformers' (`ref`), and every block must be free afterwards."""
    llm = engine(path, backend, **kwargs)
    assert llm.engine.core.runner.backend.name == backend
    # The reference runs in float32 on the CPU; on a GPU, cuDNN's TF32 convolutions (the patch
    # embeddings) would round differently enough to flip a random model's near-tied tokens.
    tf32, torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32, False
    try:
        outs = llm.generate([mm(p, imgs) for p, imgs, _ in cases], [greedy(n) for *_, n in cases])
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    for out, (text, imgs, n) in zip(outs, cases, strict=True):
        assert out.prompt_token_ids == ref.inputs(text, imgs)["input_ids"][0].tolist(), text
        assert out.outputs[0].token_ids == ref.generate(text, imgs, n), text
    assert_all_free(llm)
    return outs
