"""The Litestar app: `create_app(async_llm, settings)`.

The app does not own the engine: whoever made the `AsyncLLM` shuts it down (the server does after
uvicorn returns), so tests can put several apps in front of one engine. The image limits are the
engine's, given when it is built (`mm-engine serve` builds it with `settings.image_limits()`), and
so is its metrics listener: the app serves the engine's `Metrics` at `/metrics` (an engine built
without one gets a fresh registry whose request series stay at zero, and a warning says so).
"""

from __future__ import annotations

import logging
from pathlib import Path

from litestar import Litestar
from litestar.datastructures import State
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin, YamlRenderPlugin

from mm_engine.api.access import access_middleware
from mm_engine.api.client_sequences import ClientSequences
from mm_engine.api.context import ServerContext
from mm_engine.api.errors import EXCEPTION_HANDLERS
from mm_engine.api.media import MediaFetcher
from mm_engine.api.metrics import Metrics
from mm_engine.api.request_id import request_id_middleware
from mm_engine.api.routes_batches import cancel_batch, create_batch, list_batches, retrieve_batch
from mm_engine.api.routes_caption import create_caption
from mm_engine.api.routes_chat import create_chat_completion
from mm_engine.api.routes_completions import create_completion, detokenize, tokenize
from mm_engine.api.routes_files import create_file, delete_file, file_content, list_files, retrieve_file
from mm_engine.api.routes_misc import health, health_head, list_models, metrics, playground, retrieve_model
from mm_engine.api.settings import ServerSettings
from mm_engine.async_llm import AsyncLLM

logger = logging.getLogger("mm_engine.api")

ROUTES = [create_caption, create_chat_completion, create_completion, tokenize, detokenize, list_models,
          retrieve_model, health, health_head, metrics, playground, create_file, list_files, retrieve_file,
          file_content, delete_file, create_batch, list_batches, retrieve_batch, cancel_batch]  # fmt: skip


def create_app(
    llm: AsyncLLM, settings: ServerSettings | None = None, *, fetcher: MediaFetcher | None = None
) -> Litestar:
    settings = settings or ServerSettings()
    listener = llm.listener
    if isinstance(listener, Metrics):
        metrics_ = listener
    else:
        logger.warning("the engine was built without listener=Metrics(...): /metrics has no request series")
        metrics_ = Metrics(llm.model_info.max_num_seqs)
    fetcher = fetcher or MediaFetcher(
        settings.allowed_media_domains,
        settings.max_image_bytes,
        settings.media_fetch_timeout,
        settings.media_max_redirects,
    )
    clients = ClientSequences(settings.max_sequences_per_client, settings.retry_after_seconds)
    ctx = ServerContext(llm, settings, metrics_, fetcher, clients)
    starts, stops = [], [fetcher.aclose]
    if settings.batch_dir is not None:
        from mm_engine.batch.runner import BatchRunner

        ctx.batches = BatchRunner(ctx, Path(settings.batch_dir), priority=settings.batch_priority,
                                  max_in_flight=settings.batch_max_in_flight,
                                  max_line_bytes=settings.max_body_bytes)  # fmt: skip
        if settings.api_server_index == 0:  # one runner per batch folder; every server answers routes
            starts.append(ctx.batches.start)
            stops.insert(0, ctx.batches.stop)
    return Litestar(
        route_handlers=ROUTES,
        state=State({"ctx": ctx}),
        exception_handlers=EXCEPTION_HANDLERS,
        middleware=[request_id_middleware, access_middleware(settings)],
        request_max_body_size=settings.max_body_bytes,
        # Parts beyond the images and the few text fields are refused while parsing.
        multipart_form_part_limit=settings.max_images_per_request + 16,
        openapi_config=OpenAPIConfig(
            title="mm-engine",
            version="0.1.0",
            description="Multimodal LLM serving: multipart captioning and OpenAI-compatible chat.",
            # The schema as JSON and YAML only: the HTML viewers load their scripts from a CDN.
            render_plugins=[JsonRenderPlugin(), YamlRenderPlugin()],
        ),
        on_startup=starts,
        on_shutdown=stops,
        logging_config=None,  # the server (uvicorn) owns logging; Litestar's would reset it
        debug=False,
    )
