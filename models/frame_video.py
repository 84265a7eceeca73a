"""Families whose clip is a run of frames, each processed like one image and a span of its own
(InternVL, LLaVA-OneVision): the video half of their `Processing`, shared. A family sets it up
with `init_video` where its checkpoint has a video processor and placeholder, checks its own
`mm_processor_kwargs` (`check_options`), and writes each frame's run (`frame_run`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

from mm_engine.models.interface import ProcessedImage, Processing
from mm_engine.models.options import frame_sampling
from mm_engine.vision.video_io import FrameSampling, Video, video_content_hash


class FrameVideo(Processing):
    video_hf: Any = None  # transformers' video processor of the checkpoint; None: no video

    def init_video(
        self, video_hf, token: str, token_id: int, base: FrameSampling, options: Mapping[str, Any] | None
    ) -> None:
        self.video_hf, self.video_token, self.video_token_id = video_hf, token, token_id
        self.check_options(options)
        self.sampling = frame_sampling(base, options)
        self._video_salt = json.dumps(video_hf.to_dict(), sort_keys=True, default=str).encode()

    def check_options(self, options: Mapping[str, Any] | None) -> None:
        """Refuse, by name, the `mm_processor_kwargs` this family does not take."""
        raise NotImplementedError

    def frame_run(self, index: int, last: bool, pixels: torch.Tensor, key: str) -> ProcessedImage:
        """Frame `index` of its clip (`last`: the clip's last): pixels `[1, 3, H, W]` as the video
        processor made them, `key` its content hash."""
        raise NotImplementedError

    def video_sampling(self, overrides: Mapping[str, Any] | None = None) -> FrameSampling:
        if self.video_token_id is None:
            return super().video_sampling(overrides)
        self.check_options(overrides)
        return frame_sampling(self.sampling, overrides)

    def process_video(
        self, video: Video, overrides: Mapping[str, Any] | None = None, group_tokens: int | None = None
    ) -> list[ProcessedImage]:
        if self.video_token_id is None:
            return super().process_video(video, overrides, group_tokens)
        out = self.video_hf(videos=[video.frames], do_sample_frames=False, return_tensors="pt")
        frames = out["pixel_values_videos"][0]
        digest = video_content_hash(video, self._video_salt)
        n = frames.shape[0]
        return [self.frame_run(i, i == n - 1, frames[i : i + 1], f"{digest}:{i}") for i in range(n)]
