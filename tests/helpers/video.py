"""Clips for the video tests: random frames with some structure, and an mp4 of them (PyAV)."""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np
import torch


def clip(seed: int, frames: int, size: tuple[int, int]) -> torch.Tensor:
    """Random frames `[T, H, W, 3]`, each a smooth gradient plus noise (not all noise: the tiny
    towers then see structure)."""
    g = torch.Generator().manual_seed(seed)
    h, w = size
    ramp = torch.linspace(0, 255, w).expand(frames, h, w)
    rgb = torch.stack([ramp, ramp.flip(-1), torch.full((frames, h, w), 40.0 * seed % 255)], -1)
    noise = torch.randint(-30, 30, rgb.shape, generator=g)
    return (rgb + noise).clamp(0, 255).to(torch.uint8)


def mp4(frames: torch.Tensor, fps: int) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt, stream.options = "yuv444p", {"crf": "0", "g": "8"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame.numpy(), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def long_clip(frames: int = 2, seconds_apart: int = 3600) -> bytes:
    """Frames an hour apart: a clip of hours in a few hundred bytes (a duration limit's test)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=Fraction(1, seconds_apart))
        stream.height, stream.width, stream.pix_fmt = 32, 32, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), i * 90, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def png_bytes() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(buf, format="PNG")
    return buf.getvalue()
