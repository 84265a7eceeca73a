"""SmolVLM2's video: each sampled frame a global-image run with its time written before it, the
clip's intro and outro around them, all tokenized with the prompt as its processor does. On a
byte-level vocabulary, so that the intro and the times are spelled out: the same frames through
the engine and through transformers' processor and `generate` give equal greedy tokens (one clip,
an image and a clip, two clips of different lengths and rates, text only, one mixed batch, blocks
of 8 and a step budget of 16) on every backend; an mp4 sampled by SmolVLM2's own rule; options,
refusals, the chat template and a captioning job."""

from __future__ import annotations

import base64
import json

import pytest
import torch

from helpers.families import assert_all_free, engine, greedy
from helpers.images import make_image
from helpers.reference import FamilyReference
from helpers.video import clip, mp4
from mm_engine.testing.idefics import build_idefics_checkpoint
from mm_engine.vision.video_io import FrameSampling, load_video


def prompt(question: str, *parts: str) -> str:
    return f"<|endoftext|>User:{''.join(parts)} {question}<end_of_utterance>\nAssistant:"


# (prompt, images, [(frames, fps)], max tokens)
CASES = [
    (prompt("what happens", "<video>"), [], [(clip(1, 5, (40, 56)), 2.0)], 9),
    (prompt("compare them", "<image>", "<video>"), [make_image(2, (50, 40))],
     [(clip(2, 3, (32, 48)), 1.0)], 8),
    (prompt("which is longer", "<video>", "<video>"), [],
     [(clip(3, 6, (24, 40)), 1.5), (clip(4, 2, (48, 32)), 4.0)], 10),
    (prompt("how many shapes are there"), [], [], 7),
]  # fmt: skip


@pytest.fixture(scope="module")
def smolvlm2(tmp_path_factory):
    path = str(
        build_idefics_checkpoint(tmp_path_factory.mktemp("smolvlm2"), "smolvlm", seed=1, byte_level=True)
    )
    return path, FamilyReference(path)


def reference_inputs(ref: FamilyReference, text: str, images: list, videos: list, **sampling) -> dict:
    """The processor's token ids for the prompt; the pixels of its images and frames in prompt
    order (its own `pixel_values` keeps only the clips' when a prompt has both)."""
    from transformers.video_utils import VideoMetadata

    proc = ref.processor
    kwargs = {}
    if videos:
        meta = [
            VideoMetadata(total_num_frames=len(f), fps=fps, frames_indices=list(range(len(f))))
            for f, fps in videos
        ]
        kwargs = dict(
            videos=[f for f, _ in videos], videos_kwargs=dict(video_metadata=meta, do_sample_frames=False)
        )
    out = proc(text=text, images=[images] if images else None, return_tensors="pt", **kwargs)
    if not images and not videos:
        return dict(out)
    pixels = iter(proc.image_processor(images=[[i]], return_tensors="pt")["pixel_values"][0] for i in images)
    video_proc = proc.video_processor
    frames = iter(video_proc(videos=[f], do_sample_frames=False, return_tensors="pt")["pixel_values"][0]
                  for f, _ in videos)  # fmt: skip
    order = [next(pixels) if part == "<image>" else next(frames) for part in _placeholders(text)]
    stacked = torch.cat(order)[None]
    mask = torch.ones(stacked.shape[:2] + stacked.shape[-2:], dtype=torch.long)
    return dict(input_ids=out["input_ids"], attention_mask=out["attention_mask"], pixel_values=stacked,
                pixel_attention_mask=mask)  # fmt: skip


def _placeholders(text: str) -> list[str]:
    import re

    return re.findall("<image>|<video>", text)


@torch.inference_mode()
def reference_generate(ref: FamilyReference, inputs: dict, n: int) -> list[int]:
    out = ref.model.generate(**inputs, max_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def request(text: str, images: list, videos: list) -> dict:
    return {
        "prompt": text,
        "multi_modal_data": {"image": images, "video": [(f, {"fps": r}) for f, r in videos]},
    }


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_clips_match_transformers_in_a_mixed_batch(smolvlm2, backend):
    path, ref = smolvlm2
    llm = engine(path, backend)
    outs = llm.generate([request(t, i, v) for t, i, v, _ in CASES], [greedy(n) for *_, n in CASES])
    for out, (text, images, videos, n) in zip(outs, CASES, strict=True):
        inputs = reference_inputs(ref, text, images, videos)
        assert out.prompt_token_ids == inputs["input_ids"][0].tolist(), text
        assert out.outputs[0].token_ids == reference_generate(ref, inputs, n), text
    decoded = llm.engine.tokenizer.decode(outs[2].prompt_token_ids)
    # Frames given already sampled: a clip's length is its last frame's time, as transformers reads it.
    assert "six frames from a 0:00:03" in decoded and "two frames from a 0:00:00" in decoded
    assert "Frame from 00:03:<fake_token_around_image>" in decoded
    _, _, spans = llm.engine.inputs.process(request(*CASES[1][:3]))
    assert [s.video for s in spans] == [False] + [True] * 3  # the image, then a span a frame
    assert_all_free(llm)
    llm.close()


def test_an_mp4_is_sampled_by_smolvlm2s_rule(smolvlm2):
    """A 4-second clip at 12 fps: 1 frame a second, spread from the first frame to the last
    (0, 15, 31, 47), against transformers' processor sampling the decoded frames itself; the
    same clip again comes from the encoder and prefix caches."""
    from transformers.video_utils import VideoMetadata

    path, ref = smolvlm2
    data = mp4(clip(5, 48, (32, 48)), 12)
    every = load_video(data, FrameSampling(fps=None, num_frames=48))
    llm = engine(path, "cpu")
    text = prompt("what happens", "<video>")
    req = {"prompt": text, "multi_modal_data": {"video": data}}
    out = llm.generate([req], [greedy(8)])[0]
    meta = VideoMetadata(total_num_frames=48, fps=12.0, duration=4.0)  # as transformers' decoders give it
    kwargs = dict(videos=[every.frames], videos_kwargs=dict(video_metadata=[meta], do_sample_frames=True))
    inputs = ref.inputs(text, None, **kwargs)
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert out.outputs[0].token_ids == reference_generate(ref, dict(inputs), 8)
    assert "four frames from a 0:00:04" in llm.engine.tokenizer.decode(out.prompt_token_ids)
    again = llm.generate([req], [greedy(8)])[0]
    assert again.outputs[0].token_ids == out.outputs[0].token_ids and again.num_cached_tokens > 0
    assert llm.kv_report()["encoded"]["video"]["inputs"] == 4  # four frames, each encoded once
    assert_all_free(llm)
    llm.close()


@pytest.mark.parametrize(("total", "fps", "options"), [
    (48, 12.0, {}), (24, 2.0, {}), (300, 10.0, {}), (30, 30.0, {}), (7, 1.0, {}), (240, 24.0, {"fps": 2}),
    (600, 30.0, {"max_frames": 5}),
])  # fmt: skip
def test_sampling_is_smolvlm2s_own(total, fps, options):
    """`trimmed`: round(seconds x fps) frames up to max_frames, a second left out at each end of a
    clip long enough (300 frames at 10 fps: frames 10 to 290), repeats dropped."""
    from transformers import SmolVLMVideoProcessor
    from transformers.video_utils import VideoMetadata

    from mm_engine.models.options import frame_sampling
    from mm_engine.vision.video_io import sample_indices

    base = FrameSampling(fps=1.0, min_frames=1, max_frames=8, factor=1, spread="trimmed")
    ours = sample_indices(total, fps, frame_sampling(base, options))
    meta = VideoMetadata(total_num_frames=total, fps=fps, duration=total / fps)
    theirs = SmolVLMVideoProcessor().sample_frames(
        meta, num_frames=options.get("max_frames", 8), fps=options.get("fps", 1)
    )
    assert ours == theirs.tolist()


def test_options_and_refusals(smolvlm2):
    path, _ = smolvlm2
    llm = engine(path, "torch")
    data = mp4(clip(6, 36, (32, 32)), 6)  # 6 seconds
    text = prompt("x", "<video>")

    def frames(options: dict) -> int:
        req = {"prompt": text, "multi_modal_data": {"video": data}, "mm_processor_kwargs": options}
        return len(llm.engine.inputs.process(req)[2])

    assert frames({}) == 6 and frames({"fps": 0.5}) == 3 and frames({"num_frames": 4}) == 4
    assert frames({"max_frames": 2}) == 2 and frames({"longest_edge": 64}) == 6  # an image's option
    with pytest.raises(ValueError, match="unknown mm_processor_kwargs option 'frames'"):
        frames({"frames": 4})
    ids = llm.engine.tokenizer(text)["input_ids"]
    with pytest.raises(ValueError, match="a video needs a 'prompt' string"):
        llm.engine.inputs.process({"prompt_token_ids": ids, "multi_modal_data": {"video": data}})
    with pytest.raises(ValueError, match=r"1 video placeholder\(s\) \(<video>\) but 2 video\(s\)"):
        llm.engine.inputs.process({"prompt": text, "multi_modal_data": {"video": [data, data]}})
    with pytest.raises(ValueError, match=r"0 image placeholder\(s\) \(<image>\) but 1 image\(s\)"):
        llm.engine.inputs.process(
            {"prompt": text, "multi_modal_data": {"video": data, "image": make_image(1)}}
        )
    assert_all_free(llm)
    llm.close()


def test_chat_and_a_captioning_job_read_clips(smolvlm2, tmp_path):
    """A `video_url` part through the chat template answers as the same prompt through
    `generate`; `mm-engine caption`'s job captions a clip as the Python API does."""
    from mm_engine.jobs.caption import caption_images

    path, _ = smolvlm2
    llm = engine(path, "torch")
    data = mp4(clip(9, 24, (32, 48)), 8)
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "describe it"}]
    chat = llm.chat([{"role": "user", "content": content}], greedy(6))[0]
    direct = llm.generate([{"prompt": prompt("describe it", "<video>"), "multi_modal_data": {"video": data}}],
                          [greedy(6)])[0]  # fmt: skip
    assert chat.prompt_token_ids == direct.prompt_token_ids  # the template wrote the same prompt
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids
    folder = tmp_path / "media"
    folder.mkdir()
    (folder / "a.mp4").write_bytes(data)
    out = tmp_path / "captions.jsonl"
    summary = caption_images(folder, out, llm=llm, prompt="describe it", max_tokens=6, progress="none")
    assert (summary.captioned, summary.failed) == (1, 0)
    (record,) = map(json.loads, out.read_text().splitlines())
    assert record["caption"] == chat.outputs[0].text and record["prompt_tokens"] == len(chat.prompt_token_ids)
    assert_all_free(llm)
    llm.close()


def test_over_http_a_clip_answers_as_the_python_api(smolvlm2):
    """`video_url` on `/v1/chat/completions` and a `video` part on `/v1/caption` (the prompt text
    the clip's text is written into before tokenizing, on the server's input workers)."""
    import asyncio

    from litestar.testing import TestClient

    from mm_engine.api.app import create_app
    from mm_engine.api.settings import ServerSettings
    from mm_engine.async_llm import AsyncLLM

    path, _ = smolvlm2
    data = mp4(clip(10, 24, (32, 48)), 8)
    offline = engine(path, "torch")
    req = {"prompt": prompt("describe it", "<video>"), "multi_modal_data": {"video": data}}
    want = offline.generate([req], [greedy(6)])[0]
    offline.close()
    settings = ServerSettings(served_model_names=["m"], default_max_tokens=6)
    kw = dict(
        kv_cache_memory_bytes=8 * 1024**2, block_size=8, max_num_batched_tokens=16, attention_backend="torch"
    )
    llm = AsyncLLM.from_engine_args(path, **kw, video_limits=settings.video_limits())
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "describe it"}]
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "temperature": 0,
    }
    with TestClient(create_app(llm, settings)) as http:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want.outputs[0].text
        assert r.json()["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
        r = http.post("/v1/caption", files={"video": ("c.mp4", data, "video/mp4")},
                      data={"prompt": "describe it", "max_tokens": "6", "temperature": "0"})  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["text"] == want.outputs[0].text
        r = http.post(
            "/v1/caption", files={"video": ("c.mp4", data[:300], "video/mp4")}, data={"prompt": "x"}
        )
        assert r.status_code == 400 and "video" in r.json()["error"]["message"]
    asyncio.run(llm.shutdown())
