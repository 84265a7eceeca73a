"""What every route needs, kept in `app.state.ctx`: the engine, settings, metrics, media fetcher."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from litestar import Request

from mm_engine.api.client_sequences import ClientSequences
from mm_engine.api.errors import APIError
from mm_engine.api.media import MediaFetcher
from mm_engine.api.metrics import Metrics
from mm_engine.api.settings import ServerSettings
from mm_engine.async_llm import AsyncLLM

if TYPE_CHECKING:
    from mm_engine.batch.runner import BatchRunner


@dataclass(slots=True)
class ServerContext:
    llm: AsyncLLM
    settings: ServerSettings
    metrics: Metrics
    fetcher: MediaFetcher
    clients: ClientSequences = field(default_factory=lambda: ClientSequences(0))
    created: int = field(default_factory=lambda: int(time.time()))
    batches: BatchRunner | None = None  # the batch API's files, batches and runner (None: off)

    def model_name(self, requested: str | None) -> str:
        """The served name a request asked for (the first one when it names none), else 404."""
        names = self.settings.served_model_names
        if not requested:
            return names[0]
        if requested in names:
            return requested
        raise APIError(
            404, f"the model {requested[:200]!r} does not exist", param="model", code="model_not_found"
        )


def get_ctx(request: Request) -> ServerContext:
    return request.app.state.ctx
