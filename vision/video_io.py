"""Video intake: a clip (encoded bytes, a file, decoded frames) checked against limits and sampled
to the frames a model reads, as a `Video`.

Encoded clips are opened with PyAV (FFmpeg bundled in its wheel). Everything that decides whether
a clip is refused (container format, duration, frame size, how many frames sampling takes, the
bytes those frames decode to) is read from the container's metadata before any frame is decoded.
Frames are then decoded by seeking: the decoder jumps to the keyframe before each sampled time
when that is further than `SEEK_GAP` seconds ahead, instead of decoding the whole file.

Sampling follows transformers' video processors (`sample_frames`): at `fps` frames per second,
at least `min_frames` and at most `max_frames`, a multiple of `factor` (the tower's temporal
patch), spread evenly over the clip; or exactly `num_frames`. Two families spread them their own
way (`spread`): Qwen3-VL takes any count (its processor pads the last temporal patch) from the
first frame to the last (`linspace`); InternVL takes the middle frame of each of n equal
segments (`centers`, its `initial_shift`) and LLaVA-OneVision the first (`uniform`,
transformers' default `i x total // n`), with no minimum and no rounding; SmolVLM2 takes
`round(seconds x fps)` frames at most `max_frames`, leaves out a second at each end of a clip
long enough, spreads them from first to last rounding down and drops repeats (`trimmed`).
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

SEEK_GAP = 1.0  # seconds: a sampled frame further ahead than this is sought, not decoded to
# FFmpeg demuxers of video containers (an image piped through FFmpeg is not a clip).
CONTAINERS = frozenset({"mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm", "avi", "mpegts", "flv", "ogg", "mpeg"})


class VideoError(ValueError):
    """A clip that cannot be used, with a message safe to show the client."""


@dataclass(frozen=True, slots=True)
class VideoLimits:
    max_bytes: int = 256 * 1024 * 1024  # an encoded clip
    max_seconds: float = 3600.0  # the container's duration
    max_frame_pixels: int = 4096 * 4096  # one frame, as stored
    min_side: int = 2
    max_frames: int = 1024  # frames sampled from one clip
    max_decoded_bytes: int = 2 * 1024**3  # the sampled frames as RGB bytes


SPREADS = ("even", "linspace", "centers", "uniform", "trimmed")


@dataclass(frozen=True, slots=True)
class FrameSampling:
    """How many frames to take (module docstring): `num_frames` exactly, else at `fps`."""

    fps: float | None = 2.0
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    factor: int = 2  # frame counts are rounded down to a multiple of this
    # or "linspace" (Qwen3-VL), "centers" (InternVL), "uniform", "trimmed" (SmolVLM2): module docstring
    spread: str = "even"

    def __post_init__(self) -> None:
        if self.fps is not None and self.num_frames is not None:
            raise VideoError("fps and num_frames are exclusive: give one")
        for name in ("fps", "num_frames"):
            value = getattr(self, name)
            if value is not None and not _positive(value):
                raise VideoError(f"{name} must be a positive number, got {value!r}")
        if self.spread not in SPREADS:
            raise VideoError(f"spread must be one of {SPREADS}, got {self.spread!r}")
        if not 1 <= self.min_frames <= self.max_frames:
            raise VideoError(f"need 1 <= min_frames ({self.min_frames}) <= max_frames ({self.max_frames})")


@dataclass(slots=True)
class Video:
    frames: torch.Tensor  # [T, H, W, 3] uint8 RGB: the sampled frames
    fps: float  # the source's frame rate
    indices: list[int]  # the source frame of each sampled frame
    total_frames: int  # frames in the source
    # The source's length in seconds where it was decoded here (frames / rate, as transformers'
    # decoders report it); None for frames given already sampled.
    seconds: float | None = None

    @property
    def sampled_fps(self) -> float:
        """Sampled frames per second of clip (transformers' `VideoMetadata.sampled_fps`)."""
        return len(self.indices) / self.total_frames * self.fps

    @property
    def timestamps(self) -> list[float]:
        return [i / self.fps for i in self.indices]


@dataclass(frozen=True, slots=True)
class ClipInfo:
    frames: int
    fps: float
    width: int
    height: int
    seconds: float


def sample_indices(total: int, fps: float, sampling: FrameSampling) -> list[int]:
    """The source frames to take from a clip of `total` frames at `fps` (module docstring)."""
    if sampling.spread != "even":
        return _spread_indices(total, fps, sampling)
    factor = sampling.factor
    if sampling.num_frames is not None:
        n = max(factor, round(sampling.num_frames / factor) * factor)
    else:
        most = math.floor(min(sampling.max_frames, total) / factor) * factor
        n = min(max(total / fps * sampling.fps, sampling.min_frames), most, total)
        n = math.floor(n / factor) * factor
    n = n or min(total, factor)  # a clip shorter than one temporal patch: all of it (padded later)
    if n > total:
        raise VideoError(f"num_frames={n} is more than the clip's {total} frames")
    return torch.arange(0, total, total / n).int().tolist()[:n]


def _spread_indices(total: int, fps: float, sampling: FrameSampling) -> list[int]:
    if sampling.spread == "trimmed":
        return _trimmed_indices(total, fps, sampling)
    n = sampling.num_frames
    if n is None and sampling.spread == "linspace":
        n = min(max(int(total / fps * sampling.fps), sampling.min_frames), sampling.max_frames, total)
    elif n is None:
        n = max(int(total / fps * sampling.fps), 1 if sampling.spread == "uniform" else 0)
    if n > total:
        raise VideoError(f"num_frames={n} is more than the clip's {total} frames")
    if n < 1:
        raise VideoError(
            f"the clip's {total} frames at {sampling.fps} per second sample no frame: ask for num_frames"
        )
    if sampling.spread == "linspace":
        return np.linspace(0, total - 1, n).round().astype(int).tolist()
    if sampling.spread == "uniform":
        return [i * total // n for i in range(n)]
    return torch.arange(total / n / 2, total, total / n).int().tolist()


def _trimmed_indices(total: int, fps: float, sampling: FrameSampling) -> list[int]:
    """SmolVLM2's rule (its video processor's `sample_frames`, with one second left out at each
    end when the clip is longer than two seconds plus its frame cap at the sampling rate)."""
    seconds = total / fps
    rate = sampling.fps or 1.0  # with num_frames, the trim test reads the processor's 1 fps
    cap = sampling.num_frames or sampling.max_frames
    n = sampling.num_frames or max(min(round(rate * seconds), sampling.max_frames), 1)
    if n > total and sampling.num_frames is not None:
        raise VideoError(f"num_frames={n} is more than the clip's {total} frames")
    start, end = 0, total - 1
    if seconds - 2 > cap * rate:
        start, end = int(fps), min(int(total - fps), total - 1)
        if start >= end:
            start, end = 0, total - 1
    return np.unique(np.linspace(start, end, n, dtype=int)).tolist()


def probe(data: bytes | Path, limits: VideoLimits) -> ClipInfo:
    """The clip's metadata, checked against `limits`; no frame is decoded."""
    with _open(data) as container:
        return _info(container, limits)


def load_video(
    obj: Any, sampling: FrameSampling, limits: VideoLimits | None = None, *, name: str = "video"
) -> Video:
    """A clip as encoded bytes or a file path (sampled here), or frames already sampled: a list of
    PIL images, a `[T, H, W, 3]` uint8 array or tensor, or `(frames, {"fps": ...})` (frames
    without a rate are taken at the sampling's fps)."""
    limits = limits or VideoLimits()
    try:
        if isinstance(obj, bytes | bytearray | memoryview | Path):
            return _decode(obj, sampling, limits)
        if isinstance(obj, str):
            raise VideoError("a video string must be a data: URL")
        fps = None
        if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[1], dict):
            obj, fps = obj[0], obj[1].get("fps")
        return _from_frames(obj, fps or sampling.fps or 2.0, limits)
    except VideoError as exc:
        raise VideoError(f"{name}: {exc}") from None


def _from_frames(frames: Any, fps: float, limits: VideoLimits) -> Video:
    if isinstance(frames, list | tuple) and frames and all(isinstance(f, Image.Image) for f in frames):
        frames = np.stack([np.asarray(f.convert("RGB")) for f in frames])
    if isinstance(frames, np.ndarray):
        frames = torch.from_numpy(np.ascontiguousarray(frames))
    if not isinstance(frames, torch.Tensor):
        raise VideoError(
            f"expected encoded bytes, a path, a list of PIL images or a [T, H, W, 3] array, got "
            f"{type(frames).__name__}"
        )
    if frames.dim() != 4 or frames.shape[-1] != 3 or frames.dtype != torch.uint8 or frames.shape[0] == 0:
        raise VideoError(
            f"frames must be a non-empty [T, H, W, 3] uint8 array, got {list(frames.shape)} {frames.dtype}"
        )
    t, h, w, _ = frames.shape
    _check_frames(t, w, h, limits)
    if not _positive(fps):
        raise VideoError(f"fps must be a positive number, got {fps!r}")
    return Video(frames.contiguous(), float(fps), list(range(t)), t)


def _check_frames(count: int, width: int, height: int, limits: VideoLimits) -> None:
    if width * height > limits.max_frame_pixels:
        raise VideoError(f"frames of {width}x{height} are over the limit of {limits.max_frame_pixels} pixels")
    if min(width, height) < limits.min_side:
        raise VideoError(f"frames of {width}x{height} are below the minimum side of {limits.min_side} pixels")
    if count > limits.max_frames:
        raise VideoError(f"{count} frames are more than the limit of {limits.max_frames}")
    if count * width * height * 3 > limits.max_decoded_bytes:
        raise VideoError(
            f"{count} frames of {width}x{height} decode to {count * width * height * 3} bytes, over the "
            f"limit of {limits.max_decoded_bytes}; ask for fewer frames (fps, num_frames, max_frames)"
        )


def _open(data: bytes | bytearray | memoryview | Path):
    import av

    try:
        source = str(data) if isinstance(data, Path) else io.BytesIO(bytes(data))
        return av.open(source, mode="r", metadata_errors="ignore")
    except Exception as exc:  # FFmpeg's errors name paths and internals: never the client's
        raise VideoError("not a decodable video") from exc


def _info(container, limits: VideoLimits) -> ClipInfo:
    if container.format.name not in CONTAINERS:
        raise VideoError(f"not a video container (FFmpeg reads it as {container.format.name!r})")
    if not container.streams.video:
        raise VideoError("the container has no video stream")
    stream = container.streams.video[0]
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    fps = float(rate) if rate else 0.0
    seconds = 0.0
    if stream.duration is not None and stream.time_base is not None:
        seconds = float(stream.duration * stream.time_base)
    elif container.duration is not None:
        seconds = container.duration / 1_000_000
    frames = stream.frames or (round(seconds * fps) if fps else 0)
    width, height = stream.codec_context.width, stream.codec_context.height
    if not fps or not math.isfinite(fps) or fps > 1000:
        raise VideoError(f"the clip's frame rate ({fps:g}) is missing or implausible")
    if frames <= 0 or seconds <= 0:
        raise VideoError("the clip has no frames")
    if seconds > limits.max_seconds:
        raise VideoError(f"the clip is {seconds:.1f} s long, over the limit of {limits.max_seconds:g} s")
    if width * height > limits.max_frame_pixels or min(width, height) < limits.min_side:
        _check_frames(1, width, height, limits)
    return ClipInfo(frames, fps, width, height, seconds)


def _positive(value: Any) -> bool:
    return (
        isinstance(value, int | float) and not isinstance(value, bool) and value > 0 and math.isfinite(value)
    )


def _decode(
    data: bytes | bytearray | memoryview | Path, sampling: FrameSampling, limits: VideoLimits
) -> Video:
    if isinstance(data, Path):
        size = data.stat().st_size if data.is_file() else -1
        if size < 0:
            raise VideoError("the file could not be read")
    else:
        size = len(data) if not isinstance(data, memoryview) else data.nbytes
    if size == 0:
        raise VideoError("the clip is empty")
    if size > limits.max_bytes:
        raise VideoError(f"the clip is {size} bytes, over the limit of {limits.max_bytes}")
    with _open(data) as container:
        info = _info(container, limits)
        indices = sample_indices(info.frames, info.fps, sampling)
        _check_frames(len(indices), info.width, info.height, limits)
        try:
            frames = _seek_decode(container, [i / info.fps for i in indices], info.fps)
        except VideoError:
            raise
        except Exception as exc:
            raise VideoError("the clip is truncated or corrupt (a frame could not be decoded)") from exc
    return Video(torch.from_numpy(np.stack(frames)), info.fps, indices, info.frames, info.frames / info.fps)


def _seek_decode(container, times: list[float], fps: float) -> list[np.ndarray]:
    """The frame at each of `times` (ascending seconds from the clip's start): the first whose
    time is within half a frame of it or later, seeking ahead where that pays."""
    stream = container.streams.video[0]
    stream.thread_type = "AUTO"
    base = stream.time_base or Fraction(1, 1_000_000)
    start = float(stream.start_time * base) if stream.start_time is not None else 0.0
    slack = 0.5 / fps
    out: list[np.ndarray] = []
    frames, current, pending = None, -math.inf, None  # pending: decoded, not yet past its target
    for target in (start + t for t in times):
        if frames is None or target - current > SEEK_GAP:
            container.seek(int(target / base), stream=stream, backward=True, any_frame=False)
            frames, pending = container.decode(stream), None
        chosen = pending if pending is not None and current + slack >= target else None
        while chosen is None:
            frame = next(frames, None)
            if frame is None:
                break
            current = float(frame.pts * base) if frame.pts is not None else current
            pending = frame
            if current + slack >= target:
                chosen = frame
        if chosen is None:
            raise VideoError("the clip is truncated or corrupt (no frame at a sampled time)")
        out.append(chosen.to_ndarray(format="rgb24"))
    return out


def video_content_hash(video: Video, salt: bytes = b"") -> str:
    """sha256 hex of what decides the model's input: the sampled frames, their shape and rate,
    and the processing settings in `salt`."""
    h = hashlib.sha256()
    for part in (repr((list(video.frames.shape), video.sampled_fps)).encode(), salt):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    h.update(video.frames.numpy().tobytes())
    return h.hexdigest()
