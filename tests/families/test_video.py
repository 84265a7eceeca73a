"""Video through the engine (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, their MoE variants): the
same sampled frames through the engine and through transformers' processor and `generate` give
equal greedy tokens (one clip, a clip and an image, two clips of different lengths and rates,
text only, in one mixed batch, blocks of 8 and a step budget of 16 tokens that splits every
clip), on every backend; a clip written to mp4 round trips through decoding; Qwen3-VL's sampling
and timestamps are its processor's; families that do not read video refuse it by name."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from helpers.families import assert_all_free, engine, greedy
from helpers.images import make_image
from helpers.video import clip, mp4
from mm_engine.vision.video_io import FrameSampling, load_video

VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def prompt(question: str, *parts: str) -> str:
    return f"<|im_start|>user {''.join(parts)}{question}<|im_end|> <|im_start|>assistant "


# (prompt, images, [(frames, fps)], max tokens)
CASES = [
    (prompt("what happens", VIDEO), [], [(clip(1, 6, (40, 56)), 3.0)], 9),
    (prompt("compare them", IMAGE, VIDEO), [make_image(2, (50, 40))], [(clip(2, 4, (32, 48)), 2.0)], 8),
    (
        prompt("which is longer", VIDEO, VIDEO),
        [],
        [(clip(3, 8, (24, 40)), 1.5), (clip(4, 3, (48, 32)), 4.0)],
        10,
    ),
    (prompt("how many shapes are there"), [], [], 7),
]


def reference_kwargs(videos: list[tuple[torch.Tensor, float]]) -> dict:
    """transformers' processor on the same frames: no sampling of its own, the frames' rate as
    metadata (Qwen2.5-VL's seconds per patch), the per-frame pixel cap the engine applies."""
    from transformers.video_utils import VideoMetadata

    if not videos:
        return {}
    meta = [
        VideoMetadata(total_num_frames=len(f), fps=fps, frames_indices=list(range(len(f))))
        for f, fps in videos
    ]
    opts = dict(video_metadata=meta, do_sample_frames=False, cap_pixels_per_frame=True)
    return dict(videos=[f for f, _ in videos], videos_kwargs=opts)


def request(text: str, images: list, videos: list[tuple[torch.Tensor, float]]) -> dict:
    data = {"image": images, "video": [(f, {"fps": fps}) for f, fps in videos]}
    return {"prompt": text, "multi_modal_data": data}


@pytest.fixture(
    scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"]
)
def family(request, vl_family):
    return vl_family(request.param)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_clips_match_transformers_in_a_mixed_batch(family, backend):
    path, ref = family
    llm = engine(path, backend)
    outs = llm.generate([request(t, i, v) for t, i, v, _ in CASES], [greedy(n) for *_, n in CASES])
    for out, (text, images, videos, n) in zip(outs, CASES, strict=True):
        kwargs = reference_kwargs(videos)
        assert out.prompt_token_ids == ref.inputs(text, images, **kwargs)["input_ids"][0].tolist(), text
        assert out.outputs[0].token_ids == ref.generate(text, images, n, **kwargs), text
    assert max(len(o.prompt_token_ids) for o in outs) > 16  # every clip split across chunks
    assert_all_free(llm)
    llm.close()


def test_an_mp4_clip_is_sampled_and_equals_transformers_on_its_frames(vl_family):
    """A 4-second clip at 12 fps, sampled at 2 fps by the engine: 8 of its 48 frames, whose rate
    (2 per second) sets Qwen2.5-VL's time positions."""
    from transformers.video_utils import VideoMetadata

    path, ref = vl_family("qwen2_5_vl")
    data = mp4(clip(5, 48, (32, 48)), 12)
    sampled = load_video(data, FrameSampling(fps=2.0))
    assert sampled.indices == list(range(0, 48, 6)) and sampled.sampled_fps == 2.0
    llm = engine(path, "torch")
    text = prompt("what happens", VIDEO)
    out = llm.generate([{"prompt": text, "multi_modal_data": {"video": data}}], [greedy(8)])[0]
    meta = VideoMetadata(total_num_frames=48, fps=12.0, frames_indices=sampled.indices)
    opts = dict(video_metadata=[meta], do_sample_frames=False, cap_pixels_per_frame=True)
    kwargs = dict(videos=[sampled.frames], videos_kwargs=opts)
    assert out.prompt_token_ids == ref.inputs(text, None, **kwargs)["input_ids"][0].tolist()
    assert out.outputs[0].token_ids == ref.generate(text, None, 8, **kwargs)
    # The same clip again hits the encoder cache and the prefix cache.
    again = llm.generate([{"prompt": text, "multi_modal_data": {"video": data}}], [greedy(8)])[0]
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    assert again.num_cached_tokens > 0
    encoded = llm.kv_report()["encoded"]["video"]
    _, _, spans = llm.engine.inputs.process({"prompt": text, "multi_modal_data": {"video": data}})
    assert len(spans) > 1  # the clip's tokens in groups of at most the step budget (16)
    assert encoded["inputs"] == len(spans)  # each group encoded once: the repeat hit the cache
    assert encoded["tokens"] == sum(s.length for s in spans)
    llm.close()


def test_sampling_options_per_request(vl_family):
    path, _ = vl_family("qwen2_vl")
    llm = engine(path, "torch")
    data = mp4(clip(6, 24, (32, 32)), 8)
    text = prompt("what happens", VIDEO)

    def video_tokens(options: dict) -> int:
        req = {"prompt": text, "multi_modal_data": {"video": data}, "mm_processor_kwargs": options}
        _, _, spans = llm.engine.inputs.process(req)
        offsets = list(itertools.accumulate([0] + [s.grid[0] for s in spans[:-1]]))
        assert all(s.video for s in spans) and [s.time_offset for s in spans] == offsets
        return sum(s.grid[0] for s in spans)  # a clip in groups of whole temporal patches

    assert video_tokens({}) == 3  # 3 s at 2 fps: 6 frames, 3 temporal patches
    assert video_tokens({"fps": 4}) == 6
    assert video_tokens({"num_frames": 4}) == 2
    assert video_tokens({"max_frames": 4}) == 2
    with pytest.raises(ValueError, match="num_frames"):
        video_tokens({"num_frames": 0})
    with pytest.raises(ValueError, match="unknown mm_processor_kwargs option 'frames'"):
        video_tokens({"frames": 4})
    llm.close()


def test_qwen3_vl_samples_and_stamps_a_clip_as_its_processor_does(tmp_path):
    """Qwen3-VL's own sampling (2 fps spread from the first frame to the last, any count: 7 of
    42 frames here, the last repeated into a fourth temporal patch) and each patch's `<t seconds>`
    between its start and end tokens: on a byte-level vocabulary, so that the times are spelled
    out, against transformers' processor sampling the same decoded frames itself."""
    from transformers.video_utils import VideoMetadata

    from helpers.reference import FamilyReference
    from mm_engine.testing.qwen import build_qwen_checkpoint

    path = str(build_qwen_checkpoint(tmp_path / "qwen3_vl", "qwen3_vl", byte_level=True))
    ref = FamilyReference(path)
    data = mp4(clip(11, 42, (32, 48)), 12)
    every = load_video(data, FrameSampling(fps=None, num_frames=42))  # the decoded frames, all
    text = f"<|im_start|>user\n{VIDEO}what happens<|im_end|>\n<|im_start|>assistant\n"
    llm = engine(path, "cpu")
    out = llm.generate([{"prompt": text, "multi_modal_data": {"video": data}}], [greedy(8)])[0]
    meta = VideoMetadata(total_num_frames=42, fps=12.0)
    opts = dict(video_metadata=[meta], do_sample_frames=True, fps=2, cap_pixels_per_frame=True)
    kwargs = dict(videos=[every.frames], videos_kwargs=opts)
    expected = ref.inputs(text, None, **kwargs)["input_ids"][0].tolist()
    assert out.prompt_token_ids == expected
    # Frames 0, 7 | 14, 20 | 27, 34 | 41 (repeated) of 12 per second: each patch at its middle.
    stamps = [f"<{t} seconds><|vision_start|>" for t in ("0.3", "1.4", "2.5", "3.4")]
    assert all(stamp in llm.engine.tokenizer.decode(expected) for stamp in stamps)
    assert out.outputs[0].token_ids == ref.generate(text, None, 8, **kwargs)
    _, _, spans = llm.engine.inputs.process({"prompt": text, "multi_modal_data": {"video": data}})
    assert [s.grid[0] for s in spans] == [1] * 4 and all(s.video for s in spans)
    assert_all_free(llm)
    llm.close()


def internvl_prompt(question: str, *parts: str) -> str:
    return f"<|im_start|>user {''.join(parts)}{question}<|im_end|> <|im_start|>assistant "


INTERNVL_CASES = [
    (internvl_prompt("what happens", "<video> "), [], [(clip(1, 6, (40, 56)), 3.0)], 8),
    (internvl_prompt("compare them", "<IMG_CONTEXT> ", "<video> "), [make_image(2, (50, 40))],
     [(clip(2, 4, (32, 48)), 2.0)], 7),
    (internvl_prompt("how many shapes are there"), [], [], 6),
]  # fmt: skip


def test_internvl_samples_the_middle_of_equal_segments(vl_family):
    """8 frames by default, each the middle of one eighth of the clip (InternVL's initial shift),
    or as many as `num_frames` / `fps` ask."""
    from transformers import InternVLVideoProcessor
    from transformers.video_utils import VideoMetadata

    path, _ = vl_family("internvl")
    llm = engine(path, "torch")
    data = mp4(clip(12, 48, (32, 32)), 12)

    def frames(options: dict) -> int:
        req = {"prompt": internvl_prompt("x", "<video> "), "multi_modal_data": {"video": data},
               "mm_processor_kwargs": options}  # fmt: skip
        return len(llm.engine.inputs.process(req)[2])

    assert frames({}) == 8 and frames({"num_frames": 5}) == 5 and frames({"fps": 1.0}) == 4
    meta = VideoMetadata(total_num_frames=48, fps=12.0)
    theirs = InternVLVideoProcessor().sample_frames(meta, num_frames=8).tolist()
    assert load_video(data, FrameSampling(None, 8, spread="centers")).indices == theirs
    llm.close()


ONEVISION_CASES = [
    ("USER: <video> what happens ASSISTANT:", [], [(clip(1, 5, (40, 56)), 3.0)], 8),
    ("USER: <image> <video> compare them ASSISTANT:", [make_image(2, (50, 40))],
     [(clip(2, 4, (32, 48)), 2.0)], 7),
    ("USER: how many shapes are there ASSISTANT:", [], [], 6),
]  # fmt: skip


FRAME_FAMILIES = {"internvl": (INTERNVL_CASES, [4] * 6), "llava_onevision": (ONEVISION_CASES, [4] * 4 + [5])}


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("name", list(FRAME_FAMILIES))
def test_frame_by_frame_clips_match_transformers_in_a_mixed_batch(vl_family, name, backend):
    """InternVL (each frame one tile, `FrameN: <img>...</img>` joined by newlines) and
    LLaVA-OneVision (each frame's features pooled 2x2, one newline after the clip's last frame),
    as their processors write them; the frames given, as transformers takes them."""
    path, ref = vl_family(name)
    cases, lengths = FRAME_FAMILIES[name]
    llm = engine(path, backend)
    batch = [request(t, i, v) for t, i, v, _ in cases]
    outs = llm.generate(batch, [greedy(n) for *_, n in cases])
    for out, (text, images, videos, n) in zip(outs, cases, strict=True):
        kwargs = dict(videos=[f for f, _ in videos]) if videos else {}
        assert out.prompt_token_ids == ref.inputs(text, images, **kwargs)["input_ids"][0].tolist(), text
        assert out.outputs[0].token_ids == ref.generate(text, images, n, **kwargs), text
    _, _, spans = llm.engine.inputs.process(batch[0])
    assert [s.length for s in spans] == lengths and all(s.video for s in spans)  # a span a frame
    assert_all_free(llm)
    llm.close()


def test_llava_onevision_samples_frames_as_transformers_does(vl_family):
    from transformers.video_utils import VideoMetadata, default_sample_indices_fn

    path, _ = vl_family("llava_onevision")
    llm = engine(path, "torch")
    data = mp4(clip(12, 45, (32, 32)), 15)

    def frames(options: dict) -> int:
        req = {"prompt": "USER: <video> x ASSISTANT:", "multi_modal_data": {"video": data},
               "mm_processor_kwargs": options}  # fmt: skip
        return len(llm.engine.inputs.process(req)[2])

    assert frames({}) == 8 and frames({"num_frames": 3}) == 3 and frames({"fps": 2.0}) == 6
    with pytest.raises(ValueError, match="not supported for this family: max_patches"):
        frames({"max_patches": 3})
    meta = VideoMetadata(total_num_frames=45, fps=15.0)
    theirs = default_sample_indices_fn(meta, num_frames=8).tolist()
    assert load_video(data, FrameSampling(None, 8, min_frames=1, spread="uniform")).indices == theirs
    llm.close()


@pytest.mark.parametrize(
    ("name", "refusal"),
    [("idefics3", "does not read video"), ("llava_next", "does not read video")],
)
def test_families_that_do_not_read_video_refuse_it_by_name(vl_family, name, refusal):
    path, _ = vl_family(name)
    llm = engine(path, "torch")
    video = (clip(7, 4, (32, 32)), {"fps": 2.0})
    text = prompt("what happens", VIDEO) if name.startswith("qwen") else "USER: <image> hi ASSISTANT:"
    with pytest.raises(ValueError, match=refusal):
        llm.generate([{"prompt": text, "multi_modal_data": {"video": video}}], [greedy(4)])
    assert_all_free(llm)
    llm.close()


def test_placeholders_and_clips_must_match(vl_family):
    path, _ = vl_family("qwen2_vl")
    llm = engine(path, "torch")
    video = (clip(8, 4, (32, 32)), {"fps": 2.0})
    with pytest.raises(ValueError, match=r"1 video placeholder\(s\) .* but 2 video\(s\)"):
        llm.engine.inputs.process(
            {"prompt": prompt("x", VIDEO), "multi_modal_data": {"video": [video, video]}}
        )
    with pytest.raises(ValueError, match="video 0: .*data: URL"):
        llm.engine.inputs.process(
            {"prompt": prompt("x", VIDEO), "multi_modal_data": {"video": "/etc/passwd"}}
        )
    llm.close()


def test_a_captioning_job_takes_clips_beside_images(vl_family, tmp_path):
    """`mm-engine caption`'s job on a folder of a clip, an image and a broken clip: one line each,
    the clip's keyed "video", its caption the Python API's for the same clip and sampling."""
    import json

    from helpers.api import image_bytes
    from mm_engine.jobs.caption import caption_images

    path, _ = vl_family("qwen2_vl")
    llm = engine(path, "torch")
    folder = tmp_path / "media"
    folder.mkdir()
    data = mp4(clip(10, 24, (32, 48)), 8)
    (folder / "a.mp4").write_bytes(data)
    (folder / "b.png").write_bytes(image_bytes(3, size=(60, 40)))
    (folder / "c.mp4").write_bytes(data[:500])
    out = tmp_path / "captions.jsonl"
    summary = caption_images(
        folder, out, llm=llm, prompt="describe it", max_tokens=5, progress="none", fps=4.0
    )
    assert (summary.captioned, summary.failed) == (2, 1)
    records = {
        Path(r.get("video") or r.get("image")).name: r for r in map(json.loads, out.read_text().splitlines())
    }
    assert "video" in records["a.mp4"] and "image" in records["b.png"] and "error" in records["c.mp4"]
    text = prompt("describe it", VIDEO)
    req = {"prompt": text, "multi_modal_data": {"video": data}, "mm_processor_kwargs": {"fps": 4.0}}
    want = llm.generate([req], [greedy(5)])[0]
    assert records["a.mp4"]["caption"] == want.outputs[0].text
    assert records["a.mp4"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert_all_free(llm)
    llm.close()


@pytest.mark.parametrize("name", ["qwen2_5_vl", "smolvlm"])
def test_bench_offline_video_workload(vl_family, monkeypatch, name):
    from bench import offline

    monkeypatch.setenv("MM_ENGINE_BENCH_IN_PROCESS", "1")  # its runs without a spawn each
    path, _ = vl_family(name)
    res = offline.main(
        ["--model", path, "--workload", "video", "--num-images", "3", "--hf-batch-size", "3", "--check", "3",
         "--threads", "1", "--kv-cache-memory-bytes", str(8 * 1024**2), "--rate-sizes", "128"]
    )  # fmt: skip
    assert res["tokens_identical"] == "3/3" and res["workload"] == "video"


def test_bench_video_ttft_runs(vl_family):
    from bench import video_ttft

    path, _ = vl_family("qwen2_5_vl")
    res = video_ttft.main(["--model", path, "--seconds", "2", "--fps", "2", "--runs", "1", "--threads", "1"])
    (row,) = res["runs"]
    assert row["frames"] == 4 and row["video_tokens"] > 0 and res["ttft_s_median"] > 0
