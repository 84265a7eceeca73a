"""The engine behind the HTTP server: one engine thread, many asyncio clients.

    event loop (any number)                 engine thread (exactly one: LLMEngine is not thread-safe)
    generate() --add--> inbox (deque+cond) --> add_processed / abort / call
    collector.get() <--call_soon_threadsafe-- step() -> one batch of delta outputs per step

Tokenizing and decoding images happen in worker threads (`process_prompt`, `process_chat`), never
on the event loop and never on the engine thread; small inputs have workers of their own
(input_lanes.py). A request whose consumer goes away (client disconnect, cancellation) is
aborted, which frees its blocks at once. A step that fails fails the requests it held with
`EngineStepError` (their blocks are freed) and is recorded for the health check; the loop keeps
serving the others. A device fault (a CUDA error) stops the loop: every request gets
`EngineDeadError` and `/health` says "dead" and why. The request side is
mm_engine/engine/async_engine.py, the engine thread mm_engine/engine/engine_thread.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mm_engine.config import EngineConfig
from mm_engine.engine.async_engine import AsyncEngine
from mm_engine.engine.async_types import ModelInfo, StatsListener
from mm_engine.engine.engine_thread import EngineThread
from mm_engine.engine.llm_engine import LLMEngine
from mm_engine.frontend.input_lanes import LIGHT_INPUT_BYTES


class AsyncLLM(AsyncEngine):
    def __init__(
        self,
        engine: LLMEngine,
        *,
        input_workers: int = 2,
        light_input_bytes: int = LIGHT_INPUT_BYTES,
        stall_timeout: float = 60.0,
        listener: StatsListener | None = None,
    ) -> None:
        self.engine = engine
        super().__init__(
            engine.inputs,
            ModelInfo(engine.max_model_len, engine.config.max_num_seqs, engine.inputs.tool_format),
            lambda shared: EngineThread(engine, shared),
            max_waiting=engine.config.max_waiting_requests,
            stats=engine.stats(),
            platform=engine.platform_info(),
            input_workers=input_workers,
            light_input_bytes=light_input_bytes,
            stall_timeout=stall_timeout,
            listener=listener,
        )

    @classmethod
    def from_engine_args(cls, model: str | None = None, **kwargs: Any) -> AsyncLLM:
        """`AsyncLLM.from_engine_args(model, kv_cache_memory_bytes=..., stall_timeout=...,
        image_limits=...)`."""
        limits = kwargs.pop("image_limits", None)
        video_limits = kwargs.pop("video_limits", None)
        own = {k: kwargs.pop(k) for k in list(kwargs) if k not in EngineConfig.__dataclass_fields__}
        engine = LLMEngine(
            EngineConfig.from_kwargs(model, **kwargs), image_limits=limits, video_limits=video_limits
        )
        return cls(engine, **own)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between steps (after every command sent before)."""
        thread: EngineThread = self._driver  # type: ignore[assignment]
        return await thread.call(fn)
