"""`POST /v1/caption`: multipart image (or video) upload in, caption out (JSON, or server-sent events).

The prompt: one containing the model's image placeholder (`<image>`) is used as is, one placeholder
per uploaded image; any other prompt is a question put after the images in one user message
rendered with the model's chat template (like `mm-engine generate` and the batch captioner).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated

from litestar import Request, post
from litestar.enums import RequestEncodingType
from litestar.params import Body

from mm_engine.api.caller import HttpCaller
from mm_engine.api.context import ServerContext, get_ctx
from mm_engine.api.errors import APIError, client_errors
from mm_engine.api.limits import (
    check_image_count,
    check_stop,
    check_video_count,
    fit_max_tokens,
    sampling_params,
)
from mm_engine.api.routes_common import error_responses, require_content_type
from mm_engine.api.schemas import CaptionChunk, CaptionForm, CaptionResponse, usage_of
from mm_engine.api.streaming import DONE, error_event, last_output, sse, sse_response
from mm_engine.engine.async_types import ProcessedInputs
from mm_engine.frontend.chat_messages import TemplateChat
from mm_engine.frontend.inputs import InputProcessor
from mm_engine.outputs import RequestOutput
from mm_engine.sampling_params import RequestOutputKind
from mm_engine.vision.image_io import ImageError
from mm_engine.vision.video_io import VideoError


def process_caption(
    inputs: InputProcessor, prompt: str, images: list[bytes], videos: list[bytes] = ()
) -> ProcessedInputs:
    """Runs in the worker pool: builds the prompt around the images and clips, tokenizes, decodes."""
    videos = list(videos)
    placeholders = [inputs.image_token, inputs.processing.video_token]
    if any(p and p in prompt for p in placeholders) or inputs.chat_template is None:
        if not any(p and p in prompt for p in placeholders):  # no template to place them: media first
            if videos and inputs.processing.video_token is None:
                inputs.processing.video_sampling()  # the family says why it reads no video
            marks = [inputs.image_token] * len(images) + [inputs.processing.video_token] * len(videos)
            prompt = " ".join(marks) + " " + prompt
        data = {"image": images, "video": videos}
        return ProcessedInputs(*inputs.process({"prompt": prompt, "multi_modal_data": data}))
    parts = [{"type": "image"} for _ in images] + [{"type": "video"} for _ in videos]
    content = [*parts, {"type": "text", "text": prompt}]
    chat = TemplateChat([{"role": "user", "content": content}], images, videos)
    return ProcessedInputs(*inputs.chat(chat))


@post(
    "/v1/caption",
    status_code=200,
    before_request=require_content_type("multipart/form-data"),
    responses=error_responses(),
    summary="Caption uploaded images",
    description="Multipart form: one or more `image` (or `video`) file parts and optional sampling fields. "
    "With `stream=true` the answer is server-sent events of `caption.chunk` objects, then `[DONE]`.",
    operation_id="createCaption",
    tags=["caption"],
)
async def create_caption(
    request: Request, data: Annotated[CaptionForm, Body(media_type=RequestEncodingType.MULTI_PART)]
) -> CaptionResponse:  # or a Stream of server-sent events (a Response is passed through as is)
    ctx = get_ctx(request)
    arrival = time.time()
    settings = ctx.settings
    images, videos = [], []
    for upload in data.image:  # only the bytes are used, never the file name
        images.append(await upload.read())
        await upload.close()
    for upload in data.video:
        videos.append(await upload.read())
        await upload.close()
    model = ctx.model_name(data.model)
    if not images and not videos:
        raise APIError(400, "at least one 'image' or 'video' file part is required", param="image")
    check_image_count(len(images), settings, "image")
    check_video_count(len(videos), settings, "video")
    too_big = next((len(v) for v in videos if len(v) > settings.max_video_bytes), None)
    if too_big is not None:
        message = f"a video part is {too_big} bytes, over the limit of {settings.max_video_bytes}"
        raise APIError(400, message, param="video")
    caller = HttpCaller(request, ctx.clients)
    priority = caller.priority(data.priority, settings)
    fields = dict(
        temperature=data.temperature,
        top_p=data.top_p,
        seed=data.seed,
        stop=check_stop(data.stop, settings),
        ignore_eos=data.ignore_eos,
        output_kind=RequestOutputKind.DELTA if data.stream else RequestOutputKind.FINAL_ONLY,
    )
    ctx.llm.check_admission()
    # An empty or blank prompt is no prompt: the default one, not a caption of nothing.
    prompt = settings.default_caption_prompt if not (data.prompt or "").strip() else data.prompt
    try:
        inputs = await ctx.llm.run_in_worker(process_caption, ctx.llm.inputs, prompt, images, videos)
    except ImageError as exc:
        raise APIError(400, str(exc), param="image", code="invalid_image") from None
    except VideoError as exc:
        raise APIError(400, str(exc), param="video", code="invalid_video") from None
    except ValueError as exc:
        raise APIError(400, str(exc), param="prompt", code="invalid_value") from None
    max_tokens = fit_max_tokens(data.max_tokens, len(inputs.token_ids), ctx.llm.model_info.max_model_len,
                                settings, "max_tokens", "prompt")  # fmt: skip
    params = sampling_params(**fields, max_tokens=max_tokens)
    rid = f"caption-{uuid.uuid4().hex}"
    (gen,) = caller.hold([ctx.llm.generate(inputs, params, rid, priority, arrival)])
    head = _Head(rid, int(arrival), model)
    with client_errors(None):
        if not data.stream:
            return head.response(await caller.run(last_output(gen)))
        first = await caller.run(anext(gen))
    return sse_response(_events(ctx, head, first, gen))


class _Head:
    def __init__(self, rid: str, created: int, model: str) -> None:
        self.rid, self.created, self.model = rid, created, model

    def response(self, out: RequestOutput) -> CaptionResponse:
        c = out.outputs[0]
        return CaptionResponse(self.rid, self.created, self.model, c.text, c.finish_reason, usage_of(out))

    def chunk(self, out: RequestOutput, generated: int) -> bytes:
        c = out.outputs[0]
        usage = usage_of(out, generated) if out.finished else None
        return sse(CaptionChunk(self.rid, self.created, self.model, out.delta_text, c.finish_reason, usage))


async def _events(
    ctx: ServerContext, head: _Head, first: RequestOutput, gen: AsyncIterator[RequestOutput]
) -> AsyncIterator[bytes]:
    try:
        generated = len(first.outputs[0].token_ids)  # outputs are deltas
        yield head.chunk(first, generated)
        if not first.finished:
            async for out in gen:
                generated += len(out.outputs[0].token_ids)
                yield head.chunk(out, generated)
    except Exception as exc:  # the status line is gone already: report it in the stream
        yield error_event(exc, ctx.settings.retry_after_seconds)
    finally:
        await gen.aclose()  # no-op when finished; aborts the request when the client left
    yield DONE
