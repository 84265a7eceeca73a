"""`AsyncMPLLM`: the async engine with its core in processes of their own, one or several
(`data_parallel_size`), driven by reader threads (core_processes.py). The request side is the
same as `AsyncLLM`'s (async_engine.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from mm_engine.config import EngineConfig
from mm_engine.engine.async_engine import AsyncEngine
from mm_engine.engine.async_types import ModelInfo, StatsListener
from mm_engine.engine.core_processes import CoreProcesses
from mm_engine.engine.process_client import AttachedCore, CoreProcess, start_cores
from mm_engine.engine.stats import sum_stats
from mm_engine.frontend.frontend import Frontend
from mm_engine.frontend.input_lanes import LIGHT_INPUT_BYTES
from mm_engine.models.loader import load_config, resolve_model_path
from mm_engine.vision.image_io import ImageLimits
from mm_engine.vision.video_io import VideoLimits


class AsyncMPLLM(AsyncEngine):
    def __init__(
        self,
        config: EngineConfig,
        *,
        image_limits: ImageLimits | None = None,
        video_limits: VideoLimits | None = None,
        input_workers: int = 2,
        light_input_bytes: int = LIGHT_INPUT_BYTES,
        stall_timeout: float = 60.0,
        listener: StatsListener | None = None,
        data_parallel_size: int = 1,
        affinity_slack: int | None = None,
        restart: bool = True,
        max_restarts: int = 3,
        on_dead: Callable[[], None] | None = None,
        attach: list[tuple[str, str]] | None = None,
        frontend_index: int = 0,
    ) -> None:
        """`on_dead`: called (on a reader thread) once every core is down for good.
        `affinity_slack`: how much busier than the least loaded core an image's core may be and
        still get it (default: a quarter of max_num_seqs, at least 2). `attach`: the socket pairs
        of cores someone else started (one of several API servers), `frontend_index` this
        server's index among them."""
        if attach is not None:
            data_parallel_size = len(attach)
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {data_parallel_size}")
        path = resolve_model_path(config.model)
        self.frontend = Frontend(config, path, load_config(path), image_limits, video_limits)
        core_config = dataclasses.replace(config, model=str(path))
        clients: list[CoreProcess | AttachedCore] = (
            [AttachedCore(*pair) for pair in attach]
            if attach
            else start_cores(core_config, self.frontend.max_image_tokens, data_parallel_size)
        )
        ready = clients[0].ready
        slack = max(2, ready.max_num_seqs // 4) if affinity_slack is None else affinity_slack
        driver = lambda shared: CoreProcesses(  # noqa: E731
            clients, self.frontend, shared,
            pixel_bytes=config.ipc_pixel_cache_bytes, affinity_slack=slack, restart=restart,
            max_restarts=max_restarts, on_dead=on_dead, attached=attach is not None,
            frontend_index=frontend_index,
        )  # fmt: skip
        super().__init__(
            self.frontend.inputs,
            ModelInfo(ready.max_model_len, ready.max_num_seqs, self.frontend.inputs.tool_format),
            driver,
            max_waiting=ready.max_waiting_requests * data_parallel_size,
            stats=sum_stats([c.ready.stats for c in clients]),
            platform=ready.platform,
            input_workers=input_workers,
            light_input_bytes=light_input_bytes,
            stall_timeout=stall_timeout,
            listener=listener,
        )
        self.cores: CoreProcesses = self._driver  # type: ignore[assignment]

    @classmethod
    def from_engine_args(cls, model: str | None = None, **kwargs: Any) -> AsyncMPLLM:
        own = {k: kwargs.pop(k) for k in list(kwargs) if k not in EngineConfig.__dataclass_fields__}
        return cls(EngineConfig.from_kwargs(model, **kwargs), **own)

    async def kv_reports(self) -> list[dict[str, dict]]:
        """Each core's KV report (each has its own pools); `kv_report` is the first live one's."""
        return await self.cores.kv_reports()

    def core_of(self, request_id: str) -> int | None:
        """Which core a live request runs on."""
        return self.cores.core_of(request_id)

    @property
    def restarts(self) -> int:
        return self.cores.restarts

    @property
    def client(self) -> CoreProcess:
        """The first core's process (the only one unless data-parallel)."""
        return self.cores.client

    @property
    def affinity_slack(self) -> int:
        return self.cores.affinity_slack
