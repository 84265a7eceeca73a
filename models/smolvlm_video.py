"""SmolVLM2's video: the half of `Idefics3Processing` that reads clips.

Each sampled frame is one square tile (the checkpoint's video processor resizes it to the tower's
image size) with the run of a global image, `<fake_token_around_image><global-img>` + `<image>` x
image_seq_len + `<fake_token_around_image>`. Around the runs the processor writes text: an intro
("You are provided the following series of eight frames from a 0:00:04 [H:MM:SS] video.\\n"),
"\\nFrame from MM:SS:" before each frame and "\\n\\n" after the clip. That text merges with the
prompt's own words when tokenized, so this family writes it into the prompt text before the
prompt is tokenized (`Processing.video_in_text`), as its processor does. Frames are sampled by the
processor's rule (`FrameSampling.spread="trimmed"`: 1 frame a second up to its `max_frames`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from mm_engine.models.interface import ProcessedImage, Processing
from mm_engine.models.options import SAMPLING_OPTIONS, frame_sampling
from mm_engine.vision.video_io import FrameSampling, Video, video_content_hash

DEFAULT_FPS, DEFAULT_MAX_FRAMES = 1.0, 64  # SmolVLM2's `video_sampling` where a checkpoint has none


class SmolVLMVideo(Processing):
    """Mixed into `Idefics3Processing`, whose `run` and `seq_len` it uses."""

    video_hf: Any = None  # the checkpoint's video processor; None: no video (Idefics3)

    def init_video(self, hf, options: Mapping[str, Any] | None) -> None:
        """From transformers' processor of the checkpoint, where it has a video processor, and
        the server's processor options."""
        video_hf = getattr(hf, "video_processor", None)
        if video_hf is None:
            return
        self.video_hf, self.video_in_text = video_hf, True
        self.video_token = getattr(hf, "video_token", None) or "<video>"
        base = FrameSampling(
            fps=float(video_hf.fps or DEFAULT_FPS),
            min_frames=1,
            max_frames=int(video_hf.num_frames or DEFAULT_MAX_FRAMES),
            factor=1,
            spread="trimmed",
        )
        _check_options(options)
        self.sampling = frame_sampling(base, options)  # the server's options over the checkpoint's
        self._video_salt = json.dumps(video_hf.to_dict(), sort_keys=True, default=str).encode()

    def image_options(self, options: Mapping[str, Any] | None) -> dict[str, Any]:
        """The options that are an image's (a clip's sampling options set aside where it reads video)."""
        if self.video_hf is None:
            return dict(options or {})
        return {k: v for k, v in (options or {}).items() if k not in SAMPLING_OPTIONS}

    def video_sampling(self, overrides: Mapping[str, Any] | None = None) -> FrameSampling:
        if self.video_hf is None:
            return super().video_sampling(overrides)
        _check_options(overrides)
        return frame_sampling(self.sampling, overrides)

    def process_video(
        self, video: Video, overrides: Mapping[str, Any] | None = None, group_tokens: int | None = None
    ) -> list[ProcessedImage]:
        """One span per frame (each frame is one tile), its text in `prompt_before/after`."""
        from num2words import num2words
        from transformers.models.smolvlm.processing_smolvlm import (
            DEFAULT_MEDIA_OUTTRO,
            DEFAULT_VIDEO_INTRO,
            FRAME_TIMESTAMP_MESSAGE,
        )

        if self.video_hf is None:
            return super().process_video(video, overrides, group_tokens)
        out = self.video_hf(videos=[video.frames], do_sample_frames=False, return_tensors="pt")
        frames, mask = out["pixel_values"][0], out.get("pixel_attention_mask")
        if mask is not None and not bool(mask.all()):
            raise ValueError("the video processor padded a frame, which the vision tower does not take")
        ids, embed_mask = self.run(0, 0)  # a frame is a global image's run
        n = frames.shape[0]
        # The processor's rule: the source's length, or for frames given without it the last one's time.
        duration = timedelta(
            seconds=int(video.seconds if video.seconds is not None else video.timestamps[-1])
        )
        intro = DEFAULT_VIDEO_INTRO.format(frame_count=num2words(n), video_duration=str(duration))
        digest = video_content_hash(video, self._video_salt)
        items = []
        for i, t in enumerate(video.timestamps):
            stamp = FRAME_TIMESTAMP_MESSAGE.format(timestamp=f"{int(t // 60):02d}:{int(t % 60):02d}")
            items.append(
                ProcessedImage(
                    frames[i : i + 1],
                    ids,
                    embed_mask,
                    self.seq_len,
                    f"{digest}:{i}",
                    prompt_before=(intro if i == 0 else "") + stamp,
                    prompt_after=DEFAULT_MEDIA_OUTTRO if i == n - 1 else "",
                )  # fmt: skip
            )
        return items


def _check_options(options: Mapping[str, Any] | None) -> None:
    """Refuse, by name, an option that is neither an image's nor a clip's sampling option."""
    unknown = sorted(set(options or {}) - set(SAMPLING_OPTIONS) - {"longest_edge", "size"})
    if unknown:
        raise ValueError(
            f"unknown mm_processor_kwargs option {unknown[0]!r}; supported: longest_edge, "
            f"size={{'longest_edge': N}}, {', '.join(SAMPLING_OPTIONS)}"
        )
