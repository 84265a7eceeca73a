"""Video intake (vision/video_io.py): frame sampling as transformers' video processors sample,
seek-based decoding that returns the frames a full decode would, and hostile clips refused with a
message naming the limit, from the container's metadata before frames are decoded."""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np
import pytest
import torch

from mm_engine.vision.video_io import (
    FrameSampling,
    VideoError,
    VideoLimits,
    load_video,
    probe,
    sample_indices,
)


def write(frames: int, rate, size=(32, 48), codec="libx264", gop: int = 12) -> bytes:
    """A clip whose frame i is flat grey level 8 * i (mod 256): a decoded frame says its index."""
    import av

    h, w = size
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream(codec, rate=rate)
        stream.height, stream.width, stream.pix_fmt = h, w, "yuv420p"
        stream.options = {"g": str(gop), "preset": "ultrafast"}
        for i in range(frames):
            img = np.full((h, w, 3), 8 * i % 256, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def grey_index(frame: torch.Tensor) -> int:
    return round(float(frame.float().mean()) / 8)


@pytest.mark.parametrize(
    ("total", "fps", "want"), [(300, 30.0, 2.0), (48, 12.0, 2.0), (7, 25.0, 2.0), (90, 30.0, 0.5)]
)
def test_sampling_equals_transformers(total, fps, want):
    from transformers import Qwen2VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    ours = sample_indices(total, fps, FrameSampling(fps=want))
    meta = VideoMetadata(total_num_frames=total, fps=fps)
    theirs = Qwen2VLVideoProcessor().sample_frames(meta, fps=want).tolist()
    assert ours == theirs
    assert (
        sample_indices(total, fps, FrameSampling(fps=None, num_frames=4))
        == torch.arange(0, total, total / 4).int().tolist()
    )


QWEN3_CASES = [(48, 12.0, {"fps": 2.0}), (300, 30.0, {"fps": 2.0}), (7, 24.0, {"fps": 2.0}),
               (90, 30.0, {"fps": 4.5}), (90, 30.0, {"fps": None, "num_frames": 5})]  # fmt: skip


@pytest.mark.parametrize(("total", "fps", "options"), QWEN3_CASES)
def test_qwen3_vl_sampling_is_its_processors(total, fps, options):
    """Qwen3-VL's rule (`linspace`): any count, first frame to last, at least `min_frames`."""
    from transformers import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    ours = sample_indices(total, fps, FrameSampling(**options, spread="linspace"))
    meta = VideoMetadata(total_num_frames=total, fps=fps)
    theirs = Qwen3VLVideoProcessor().sample_frames(meta, **{k: v for k, v in options.items() if v}).tolist()
    assert ours == theirs


def test_a_clip_shorter_than_a_temporal_patch_is_taken_whole():
    assert sample_indices(1, 30.0, FrameSampling()) == [0]


def test_seeking_decodes_the_frames_a_full_decode_would():
    data = write(90, 30, gop=12)  # keyframes every 0.4 s; sampled 1 s apart: each one sought
    for sampling in (FrameSampling(fps=1.0), FrameSampling(fps=6.0), FrameSampling(fps=None, num_frames=10)):
        video = load_video(data, sampling)
        assert [grey_index(f) for f in video.frames] == [i % 32 for i in video.indices]
        assert video.total_frames == 90 and video.fps == 30.0
    # 3 s at 1 fps would be 3 frames: at least min_frames (4) are taken, so 4 / 3 per second.
    assert load_video(data, FrameSampling(fps=1.0)).sampled_fps == pytest.approx(4 / 3)


def test_decoded_frames_arrays_and_pil_lists():
    from PIL import Image

    frames = torch.randint(0, 256, (5, 8, 10, 3), dtype=torch.uint8)
    video = load_video((frames.numpy(), {"fps": 4.0}), FrameSampling())
    assert torch.equal(video.frames, frames) and video.sampled_fps == 4.0 and video.indices == list(range(5))
    pil = load_video([Image.fromarray(f.numpy()) for f in frames], FrameSampling(fps=3.0))
    assert torch.equal(pil.frames, frames) and pil.sampled_fps == 3.0
    with pytest.raises(VideoError, match=r"\[T, H, W, 3\] uint8"):
        load_video(frames.float(), FrameSampling())
    with pytest.raises(VideoError, match="fps must be a positive number"):
        load_video((frames, {"fps": -1}), FrameSampling())


def png_bytes() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(buf, format="PNG")
    return buf.getvalue()


HOSTILE = [
    (lambda: b"", VideoLimits(), "empty"),
    (lambda: write(48, 12)[:2000], VideoLimits(), "not a decodable video|truncated|no frames"),
    (lambda: b"\x00\x01garbage" * 100, VideoLimits(), "not a decodable video"),
    (png_bytes, VideoLimits(), "not a video container"),
    (lambda: write(11, Fraction(1, 3600)), VideoLimits(), r"39600.0 s long, over the limit of 3600 s"),
    (lambda: write(1, 1, size=(4320, 7680)), VideoLimits(), "7680x4320 are over the limit"),
    (lambda: write(48, 12), VideoLimits(max_bytes=1000), "bytes, over the limit of 1000"),
    (lambda: write(48, 12), VideoLimits(max_frames=4), "more than the limit of 4"),
    (lambda: write(48, 12), VideoLimits(max_decoded_bytes=10_000), "over the limit of 10000; ask for fewer"),
]


@pytest.mark.parametrize(("make", "limits", "message"), HOSTILE, ids=lambda x: "" if callable(x) else None)
def test_hostile_clips_are_refused_by_name(make, limits, message):
    with pytest.raises(VideoError, match=message) as err:
        load_video(make(), FrameSampling(), limits)
    assert "/" not in str(err.value).replace("w/", "")  # no server path, no FFmpeg internals


def test_probe_reads_metadata_only():
    info = probe(write(48, 12), VideoLimits())
    assert (info.frames, info.fps, info.width, info.height) == (48, 12.0, 48, 32)
    assert info.seconds == pytest.approx(4.0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(fps=2.0, num_frames=4), "exclusive"),
        (dict(fps=0), "positive"),
        (dict(min_frames=9, max_frames=4), "min_frames"),
    ],
)
def test_bad_sampling_is_refused(options, message):
    with pytest.raises(VideoError, match=message):
        FrameSampling(**options)
