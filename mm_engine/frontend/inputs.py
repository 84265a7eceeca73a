"""From what a user passes (a prompt with the model's image placeholder and images, or chat messages)
to token ids with each placeholder expanded to the image's run of tokens, plus the processed images.
What an image becomes is the model family's `Processing`; this file is family-blind."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import PIL.Image

from mm_engine.core.structured_output import Grammars
from mm_engine.frontend.chat_messages import TemplateChat, to_template_messages
from mm_engine.models.interface import ProcessedImage, Processing
from mm_engine.request import ImageSpan
from mm_engine.sampling_params import SamplingParams
from mm_engine.vision.image_io import ImageError, ImageLimits, decode_data_url, load_image
from mm_engine.vision.video_io import VideoError, VideoLimits, load_video


class InputProcessor:
    def __init__(
        self,
        tokenizer,
        processing: Processing,
        chat_template: str | None,
        limits: ImageLimits | None = None,
        video_limits: VideoLimits | None = None,
        *,
        video_group_tokens: int | None = None,
        max_prompt_chars: int | None = None,
        grammars: Grammars | None = None,
        tool_format: str | None = None,
    ) -> None:
        """`max_prompt_chars`: longer prompt text is refused before tokenizing; `grammars`:
        compiles structured-output specs to check them; `tool_format`: how the model writes tool
        calls (None: it cannot)."""
        self.tokenizer = tokenizer
        self.processing = processing
        self.image_token_id = processing.image_token_id
        self.image_token = processing.image_token
        self.chat_template = chat_template
        self.limits = limits or ImageLimits()
        self.video_limits = video_limits or VideoLimits()
        # A clip's tokens encoded per step at most (the engine's per-step encoder budget): a long
        # clip is encoded over several steps instead of stalling one (None: whole).
        self.video_group_tokens = video_group_tokens
        self.max_prompt_chars = max_prompt_chars
        self.grammars = grammars
        self.tool_format = tool_format

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """Compile the request's grammar (cached), so a spec that cannot be compiled is refused
        here, with a ValueError naming it, and not after the engine has taken the request."""
        if params.structured_outputs is not None and self.grammars is not None:
            self.grammars.compile(params.structured_outputs)

    async def await_structured_outputs(self, params: SamplingParams) -> None:
        """The same from an event loop: waits on the compile (a thread of the grammars' own, so
        no input worker is held), at most the grammars' timeout; a compile whose every waiter
        left before it started is dropped (`Grammars.ready`)."""
        if params.structured_outputs is not None and self.grammars is not None:
            await self.grammars.ready(params.structured_outputs)

    def bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as token ids the way the model may write it: alone and after a space
        (vLLM's rule: the spaced form only where it is a different spelling of the same length)."""
        out: list[list[int]] = []
        for word in words:
            bare = self.tokenizer.encode(word.strip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.strip(), add_special_tokens=False)
            out.append(bare)
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                out.append(spaced)
        return [ids for ids in out if ids]

    def check_length(self, chars: int) -> None:
        """Refuse a prompt whose text alone cannot fit, before tokenizing it (a 4 MB prompt took
        seconds to tokenize only to be refused)."""
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise ValueError(
                f"the prompt is {chars} characters, more than any prompt of max_model_len tokens "
                f"can be ({self.max_prompt_chars})"
            )

    def process(self, prompt: Any) -> tuple[str | None, list[int], list[ImageSpan]]:
        """A string, or a dict with `prompt` (or `prompt_token_ids`), `multi_modal_data.image` and
        `mm_processor_kwargs` (processor options for this request, over the server's)."""
        if isinstance(prompt, str):
            prompt = {"prompt": prompt}
        if not isinstance(prompt, Mapping):
            raise ValueError(f"a prompt must be a string or a dict, got {type(prompt).__name__}")
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data", "mm_processor_kwargs"}
        if unknown:
            raise ValueError(f"unknown prompt field(s): {', '.join(sorted(unknown))}")
        mm = prompt.get("multi_modal_data") or {}
        if set(mm) - {"image", "video"}:
            unknown = ", ".join(sorted(set(mm) - {"image", "video"}))
            raise ValueError(f"multi_modal_data takes 'image' and 'video', got {unknown}")
        images = mm.get("image", [])
        images = list(images) if isinstance(images, list | tuple) else [images]
        videos = _videos(mm.get("video"))
        text = prompt.get("prompt")
        overrides = prompt.get("mm_processor_kwargs")
        if overrides is not None and not isinstance(overrides, Mapping):
            raise ValueError("mm_processor_kwargs must be a dict of processor options")
        if "prompt_token_ids" in prompt:
            if videos and self.processing.video_in_text:
                raise ValueError(
                    f"{_family(self.processing)} writes text around a clip's frames before tokenizing: "
                    "a video needs a 'prompt' string, not 'prompt_token_ids'"
                )
            ids = list(prompt["prompt_token_ids"])
            if not ids:
                raise ValueError("the prompt is empty")
            return text, *self.expand(ids, images, overrides, videos)
        if not isinstance(text, str):
            raise ValueError("a prompt dict needs a 'prompt' string or 'prompt_token_ids'")
        self.check_length(len(text))
        return text, *self.tokenize(text, images, overrides, videos, add_special_tokens=True)

    def tokenize(
        self, text: str, images: list[Any], overrides: Mapping[str, Any] | None, videos: list[Any],
        add_special_tokens: bool,
    ) -> tuple[list[int], list[ImageSpan]]:  # fmt: skip
        """Tokenize prompt text and expand its placeholders; a family that writes text around a
        clip's frames (`Processing.video_in_text`) gets its clips processed and written in first."""
        layout = None
        if videos and self.processing.video_in_text:
            text, layout = self._write_clips(text, videos, overrides)
            videos = []
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        if not ids:
            raise ValueError("the prompt is empty")
        return self.expand(ids, images, overrides, videos, layout)

    def _write_clips(
        self, text: str, videos: list[Any], overrides: Mapping[str, Any] | None
    ) -> tuple[str, list[ProcessedImage | None]]:
        """Each video placeholder in `text` becomes its clip's text with one image placeholder per
        frame; also returned: the image placeholders in order, None for an image, else the frame."""
        image, video = self.image_token, self.processing.video_token
        pieces = re.split(f"({re.escape(image)}|{re.escape(video)})", text)
        if pieces.count(video) != len(videos):
            raise ValueError(
                f"the prompt has {pieces.count(video)} video placeholder(s) ({video}) but {len(videos)} "
                "video(s) were given"
            )
        clips = iter([self._video(v, i, overrides) for i, v in enumerate(videos)])
        out: list[str] = []
        layout: list[ProcessedImage | None] = []
        for piece in pieces:
            if piece == video:
                frames = next(clips)
                layout.extend(frames)
                out.extend(f.prompt_before + image + f.prompt_after for f in frames)
                continue
            if piece == image:
                layout.append(None)
            out.append(piece)
        return "".join(out), layout

    def expand(
        self, ids: list[int], images: list[Any], overrides: Mapping[str, Any] | None = None,
        videos: list[Any] = (), layout: list[ProcessedImage | None] | None = None,
    ) -> tuple[list[int], list[ImageSpan]]:  # fmt: skip
        """Replace each image (and video) placeholder with its run of tokens, processing each.
        `layout` (`_write_clips`): the image placeholders in order, None for an image, else the
        video frame written there."""
        video_id = self.processing.video_token_id
        if videos and video_id is None:
            self.processing.video_sampling(overrides)  # the family's own reason, where it has one
            raise ValueError(f"{_family(self.processing)} does not read video")
        frames = sum(f is not None for f in layout or ())  # image placeholders written for frames
        placeholders = [("image", self.image_token_id, self.image_token, images, frames),
                        ("video", video_id, self.processing.video_token, videos, 0)]  # fmt: skip
        for kind, token, name, given, written in placeholders:
            n = (ids.count(token) if token is not None else 0) - written
            if n != len(given):
                raise ValueError(
                    f"the prompt has {n} {kind} placeholder(s) ({name}) but {len(given)} {kind}(s) were given"
                )
        pils = [self._load(img, i) for i, img in enumerate(images)]
        processed = iter(self._process(pils, overrides))
        # What each image placeholder gets, in order: an image's run, or a frame written there.
        order = layout if layout is not None else [None] * len(pils)
        slots = iter([(next(processed), False) if f is None else (f, True) for f in order])
        clips = iter([self._video(v, i, overrides) for i, v in enumerate(videos)])
        out: list[int] = []
        spans: list[ImageSpan] = []
        dropped = _wrappers(ids, video_id, self.processing.video_wrapper) if videos else set()
        for i, tok in enumerate(ids):
            if i in dropped:
                continue
            if tok == self.image_token_id:
                item, video = next(slots)
                items = [item]
            elif video_id is not None and tok == video_id:
                items, video = next(clips), True  # a clip's groups, one run after another
            else:
                out.append(tok)
                continue
            for item in items:
                out.extend(item.text_before)
                spans.append(
                    ImageSpan(
                        offset=len(out),
                        length=len(item.tokens),
                        pixel_values=item.pixel_values,
                        content_hash=item.content_hash,
                        embed_mask=item.embed_mask,
                        num_embeds=item.num_embeds,
                        grid=item.grid,
                        temporal_step=item.temporal_step,
                        video=video,
                        time_offset=item.time_offset,
                    )
                )
                out.extend(item.tokens)
                out.extend(item.text_after)
        return out, spans

    def _video(self, video: Any, index: int, overrides: Mapping[str, Any] | None) -> list[ProcessedImage]:
        """Decode, sample and process one clip (in groups of at most `video_group_tokens` where the
        family can split it); an error names it."""
        sampling = self.processing.video_sampling(overrides)
        if isinstance(video, str):
            if not video.startswith("data:"):
                raise VideoError(f"video {index}: a string video must be a data: URL")
            try:
                video = decode_data_url(video, "video")
            except ValueError as exc:
                raise VideoError(f"video {index}: {exc}") from None
        clip = load_video(video, sampling, self.video_limits, name=f"video {index}")
        try:
            return self.processing.process_video(clip, overrides, self.video_group_tokens)
        except VideoError:
            raise
        except ValueError as exc:
            raise VideoError(f"video {index}: {exc}") from None

    def _process(self, pils: list[PIL.Image.Image], overrides: Mapping[str, Any] | None) -> list:
        if len(pils) <= 1 or type(self.processing).process_images is Processing.process_images:
            out = []
            for index, pil in enumerate(pils):  # one at a time: an error names its image
                try:
                    out.append(self.processing.process(pil, overrides))
                except ValueError as exc:
                    raise ImageError(f"image {index}: {exc}", index) from None
            return out
        return self.processing.process_images(pils, overrides)

    def _load(self, image: Any, index: int) -> PIL.Image.Image:
        if isinstance(image, str) and not image.startswith("data:"):
            raise ImageError(f"image {index}: a string image must be a data: URL", index)
        try:
            return load_image(decode_data_url(image) if isinstance(image, str) else image, self.limits)
        except ValueError as exc:
            raise ImageError(f"image {index}: {exc}", index) from None

    def chat(
        self,
        messages: list[dict] | TemplateChat,
        overrides: Mapping[str, Any] | None = None,
        tools: list[dict] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[str, list[int], list[ImageSpan]]:
        """OpenAI-style messages (dicts, validated here, or a `TemplateChat` the HTTP route built
        from messages it validated) -> the chat template's prompt, its ids and the images in
        order. `tools`: OpenAI function tools, for the template to describe (it must have a tool
        format); `template_kwargs`: extra variables for the template (`enable_thinking`)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; use generate() with a plain prompt")
        if tools and self.tool_format is None:
            raise ValueError(
                "tool calling is not supported for this model (no tool-call format for its family)"
            )
        chat = messages if isinstance(messages, TemplateChat) else to_template_messages(messages)
        self.check_length(chat.text_chars() + len(json.dumps(tools or [])))
        extra = dict(template_kwargs or {})
        taken = sorted(set(extra) & _TEMPLATE_OWN)
        if taken:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}")
        text = self.tokenizer.apply_chat_template(
            chat.messages, chat_template=self.chat_template, tokenize=False, add_generation_prompt=True,
            tools=tools or None, **extra,
        )  # fmt: skip
        # The template writes its own special tokens; adding them again would double the BOS.
        return text, *self.tokenize(text, chat.images, overrides, chat.videos, add_special_tokens=False)


def _videos(given: Any) -> list[Any]:
    """`multi_modal_data["video"]` as a list of clips: one clip may be a list of PIL frames or a
    `(frames, {"fps": ...})` pair, so only other lists are lists of clips."""
    if given is None:
        return []
    if isinstance(given, list | tuple) and given and all(isinstance(f, PIL.Image.Image) for f in given):
        return [given]
    if isinstance(given, tuple) and len(given) == 2 and isinstance(given[1], Mapping):
        return [given]
    return list(given) if isinstance(given, list | tuple) else [given]


def _family(processing: Processing) -> str:
    return type(processing).__name__.removesuffix("Processing") or "this model"


# apply_chat_template's own arguments and what the template is given anyway: not a client's to set.
_TEMPLATE_OWN = frozenset({"conversation", "messages", "chat_template", "tokenize", "add_generation_prompt",
                           "tools", "documents", "continue_final_message", "return_dict",
                           "return_assistant_tokens_mask", "tokenizer_kwargs", "padding", "truncation",
                           "max_length", "return_tensors"})  # fmt: skip


def find_chat_template(model_dir: Path, tokenizer) -> str | None:
    """The processor's chat template (LLaVA keeps it beside the processor), else the tokenizer's."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    for name in ("chat_template.json", "processor_config.json"):
        f = model_dir / name
        if f.is_file():
            template = json.loads(f.read_text()).get("chat_template")
            if template:
                return template
    return getattr(tokenizer, "chat_template", None)


def _wrappers(ids: list[int], video_id: int | None, wrapper: tuple[int, int] | None) -> set[int]:
    """Positions of the start and end tokens right around each video placeholder, which a family
    whose frames bring their own (`Processing.video_wrapper`) drops, as its processor does."""
    if wrapper is None or video_id is None:
        return set()
    start, end = wrapper
    dropped = set()
    for i in range(1, len(ids) - 1):
        if ids[i] == video_id and ids[i - 1] == start and ids[i + 1] == end:
            dropped |= {i - 1, i + 1}
    return dropped
