"""Server settings: every limit the API enforces, with safe defaults (each is a `serve` flag)."""

from __future__ import annotations

from dataclasses import dataclass, field

from PIL import Image

from mm_engine.frontend.input_lanes import LIGHT_INPUT_BYTES
from mm_engine.vision.image_io import ImageLimits
from mm_engine.vision.video_io import VideoLimits

MiB = 1024 * 1024


@dataclass(slots=True)
class ServerSettings:
    served_model_names: list[str] = field(default_factory=lambda: ["mm-engine"])
    max_body_bytes: int = 20 * MiB  # whole request body (multipart or JSON with data: URLs)
    max_images_per_request: int = 4
    max_image_pixels: int = 4096 * 4096  # width x height, from the header, before decoding
    min_image_side: int = 2
    max_image_bytes: int = 10 * MiB  # one encoded image (upload part, data: URL payload or fetch)
    allowed_image_formats: tuple[str, ...] = ("JPEG", "PNG", "WEBP")  # identified by content
    max_videos_per_request: int = 1
    max_video_bytes: int = 16 * MiB  # one encoded clip (upload part, data: URL payload or fetch)
    max_video_seconds: float = 600.0  # a clip's duration, from its container, before decoding
    max_video_frames: int = 768  # frames sampled from one clip
    max_stop_strings: int = 4
    max_stop_length: int = 64  # characters per stop string
    default_max_tokens: int = 256  # when a request gives none (capped by what the context has left)
    default_caption_prompt: str = "Describe the image."
    allowed_media_domains: tuple[str, ...] = ()  # hosts whose http(s) image URLs may be fetched
    media_fetch_timeout: float = 10.0  # seconds for one whole fetch, redirects included
    media_max_redirects: int = 3
    header_timeout: float = 10.0  # seconds a client may take to send a request's head
    body_timeout: float = 30.0  # seconds a client may go silent while sending a body
    send_timeout: float = 30.0  # seconds a response may wait on a client that stopped reading
    shutdown_timeout: float = 30.0  # SIGTERM: seconds running requests get before being aborted
    health_stall_timeout: float = 60.0  # busy with no loop progress this long: /health says 503
    retry_after_seconds: int = 1  # Retry-After on 429 (queue full) and 503 (draining)
    input_workers: int = 2  # threads that tokenize and decode images
    light_input_bytes: int = LIGHT_INPUT_BYTES  # inputs this small have workers of their own
    api_server_index: int = 0  # which of the API servers this is (--api-server-count)
    max_prompts_per_request: int = 64  # /v1/completions: prompts in one request
    max_sequences_per_request: int = 128  # prompts x n in one request
    max_sequences_per_client: int = 1024  # in flight from one client address (0: no cap)
    api_key: str | None = None  # when set, every route but /health and the playground needs it
    api_key_metrics: bool = False  # /metrics needs the key too
    allow_client_priority: bool = False  # else a request that sets `priority` is refused
    allowed_hosts: tuple[str, ...] = ()  # Host names answered (empty: any), against DNS rebinding
    allowed_origins: tuple[str, ...] = ()  # other sites' origins whose browsers may post to us
    # The batch API (/v1/files, /v1/batches): off without a folder (`mm-engine serve` gives one).
    batch_dir: str | None = None
    max_batch_file_bytes: int = 200 * MiB  # one uploaded file of requests
    max_batch_storage_bytes: int = 20 * 1024 * MiB  # everything the batch folder holds
    batch_priority: int = 10  # a batch line's priority (10: the engine's default background tier)
    batch_max_in_flight: int = 32  # sequences the batch API has in the engine at once

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("served_model_names needs at least one name")
        for name in (
            "max_body_bytes",
            "max_images_per_request",
            "max_image_pixels",
            "min_image_side",
            "max_image_bytes",
            "max_videos_per_request",
            "max_video_bytes",
            "max_video_frames",
            "max_stop_length",
            "default_max_tokens",
            "input_workers",
            "light_input_bytes",
            "max_prompts_per_request",
            "max_sequences_per_request",
            "max_batch_file_bytes",
            "max_batch_storage_bytes",
            "batch_max_in_flight",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in (
            "max_stop_strings",
            "media_max_redirects",
            "retry_after_seconds",
            "max_sequences_per_client",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be at least 0, got {getattr(self, name)}")
        for name in (
            "media_fetch_timeout",
            "max_video_seconds",
            "header_timeout",
            "body_timeout",
            "send_timeout",
            "shutdown_timeout",
            "health_stall_timeout",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        # Our cap replaces Pillow's bomb check (the header is checked before decoding), so it may
        # only be stricter than Pillow's, never looser.
        if Image.MAX_IMAGE_PIXELS and self.max_image_pixels > Image.MAX_IMAGE_PIXELS:
            raise ValueError(
                f"max_image_pixels must be at most Pillow's limit of {Image.MAX_IMAGE_PIXELS}, "
                f"got {self.max_image_pixels}"
            )
        self.allowed_image_formats = tuple(f.upper() for f in self.allowed_image_formats)
        Image.init()
        unknown = [f for f in self.allowed_image_formats if f not in Image.OPEN]
        if unknown or not self.allowed_image_formats:
            raise ValueError(f"allowed_image_formats has unknown format(s): {', '.join(unknown) or 'none'}")
        self.allowed_media_domains = tuple(d.strip().lower().rstrip(".") for d in self.allowed_media_domains)
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty (leave it unset for no key)")
        self.allowed_hosts = tuple(h.strip().lower() for h in self.allowed_hosts if h.strip())
        self.allowed_origins = tuple(o.strip().lower().rstrip("/") for o in self.allowed_origins if o.strip())

    def image_limits(self) -> ImageLimits:
        return ImageLimits(
            max_pixels=self.max_image_pixels,
            min_side=self.min_image_side,
            max_bytes=self.max_image_bytes,
            allowed_formats=frozenset(self.allowed_image_formats),
        )

    def video_limits(self) -> VideoLimits:
        return VideoLimits(
            max_bytes=self.max_video_bytes,
            max_seconds=self.max_video_seconds,
            max_frame_pixels=self.max_image_pixels,
            min_side=self.min_image_side,
            max_frames=self.max_video_frames,
        )
