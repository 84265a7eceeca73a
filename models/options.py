"""Processor options (`mm_processor_kwargs`) shared by several families, checked the same way."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mm_engine.vision.video_io import FrameSampling

# Frame sampling options of a video, as vLLM and transformers' video processors spell them.
SAMPLING_OPTIONS = ("fps", "num_frames", "min_frames", "max_frames")


def positive_option(key: str, value) -> int:
    """A processor option that must be a positive integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"mm_processor_kwargs {key} must be a positive integer, got {value!r}")
    return value


def longest_edge(default: int, options: Mapping[str, Any] | None) -> int:
    """The side an image is resized to (Idefics3, SmolVLM, Pixtral): `longest_edge`, or vLLM's
    spelling `size: {"longest_edge": N}`; the only option these processors take here."""
    edge = default
    for key, value in (options or {}).items():
        if key == "size" and isinstance(value, Mapping) and set(value) == {"longest_edge"}:
            value = value["longest_edge"]
        elif key != "longest_edge":
            raise ValueError(
                f"unknown mm_processor_kwargs option {key!r}; supported: longest_edge, "
                "size={'longest_edge': N}"
            )
        edge = positive_option("longest_edge", value)
    return edge


def frame_sampling(base: FrameSampling, options: Mapping[str, Any] | None) -> FrameSampling:
    """`base` (a family's defaults) with the sampling options among `options` applied: `fps` and
    `num_frames` replace each other, as the processors take only one."""
    fields = {k: v for k, v in (options or {}).items() if k in SAMPLING_OPTIONS}
    for key in ("num_frames", "min_frames", "max_frames"):
        if key in fields:
            positive_option(key, fields[key])
    fps = fields.get("fps")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, int | float)):
        raise ValueError(f"mm_processor_kwargs fps must be a positive number, got {fps!r}")
    if "num_frames" in fields and "fps" not in fields:
        fields["fps"] = None
    elif "fps" in fields and "num_frames" not in fields:
        fields["num_frames"] = None
    return dataclasses.replace(base, **fields)
