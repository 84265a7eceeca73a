"""Greedy output of the engine equals transformers' `LlavaForConditionalGeneration.generate`,
token for token, on tiny random checkpoints (CLIP + Llama, SigLIP + Qwen2 with GQA)."""

from __future__ import annotations

import random

import pytest

from helpers.images import make_image
from mm_engine import LLM, SamplingParams

USER = "USER: "
QUESTIONS = [
    "what is this",
    "describe the picture",
    "how many shapes are there",
    "what color is the circle",
    "is there a red square",
    "tell me about this photo",
]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


def mm(prompt: str, images: list) -> dict:
    return {"prompt": prompt, "multi_modal_data": {"image": images}}


@pytest.fixture(scope="module", params=["clip_llama", "siglip_qwen2"])
def setup(request):
    path = request.getfixturevalue(request.param)
    ref = request.getfixturevalue("ref_" + request.param)
    return path, ref


def test_one_image_text_only_and_two_images(setup):
    path, ref = setup
    llm = LLM(path, kv_cache_memory_bytes=8 * 1024**2)
    img1, img2 = make_image(1), make_image(2, (25, 60))
    cases = [
        (f"{USER}<image> what is this ASSISTANT:", [img1]),
        (f"{USER}how many shapes are there ASSISTANT:", []),
        (f"{USER}<image> and <image> which is left ASSISTANT:", [img1, img2]),
    ]
    for prompt, images in cases:
        out = llm.generate(mm(prompt, images), greedy(12))[0]
        assert out.outputs[0].token_ids == ref.generate(prompt, images, 12), prompt
        assert out.finished and out.outputs[0].finish_reason in ("stop", "length")
    report = llm.kv_report()
    assert report["text"]["used_blocks"] == report["image"]["used_blocks"] == 0


def _mixed_batch(n: int, seed: int = 0):
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        n_images = rng.choice([0, 1, 1, 2])
        q = " ".join(rng.choice(QUESTIONS) for _ in range(rng.randint(1, 4)))
        prompt = f"{USER}{'<image> ' * n_images}{q} ASSISTANT:"
        images = [
            make_image(100 + i * 3 + k, (rng.randint(12, 90), rng.randint(12, 90))) for k in range(n_images)
        ]
        requests.append((prompt, images, rng.randint(1, 24)))
    return requests


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"max_num_batched_tokens": 8},  # smaller than one image prompt: chunked prefill
        {"block_size": 8},
    ],
    ids=["default", "chunked-prefill", "block-size-8"],
)
def test_mixed_batch_equals_each_run_alone(setup, engine_args):
    path, ref = setup
    batch = _mixed_batch(16)
    expected = [ref.generate(p, imgs, n) for p, imgs, n in batch]
    llm = LLM(path, kv_cache_memory_bytes=8 * 1024**2, **engine_args)
    outs = llm.generate([mm(p, imgs) for p, imgs, _ in batch], [greedy(n) for _, _, n in batch])
    for out, want, (prompt, _, _) in zip(outs, expected, batch, strict=True):
        assert out.outputs[0].token_ids == want, prompt
        assert len(out.prompt_token_ids) > 0
    report = llm.kv_report()
    for pool in ("text", "image"):
        assert (
            report[pool]["used_blocks"] == 0
            and report[pool]["free_blocks"] + report[pool]["cached_blocks"] == report[pool]["total_blocks"]
        )


def test_chat_applies_template_and_matches_reference(setup):
    import base64
    import io

    path, ref = setup
    img = make_image(7, (50, 40))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "what is this"},
            ],
        }
    ]
    llm = LLM(path, kv_cache_memory_bytes=8 * 1024**2)
    out = llm.chat(messages, greedy(10))[0]
    text = ref.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert out.prompt == text
    assert out.outputs[0].token_ids == ref.generate(text, [img], 10)
