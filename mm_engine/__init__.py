"""mm-engine: a multimodal (vision-language) LLM serving engine.

The public names load on first use, so that importing any submodule (`mm_engine.sched.scheduler`,
say) loads only what that submodule needs, not torch, transformers and the whole engine."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_PUBLIC = {
    "LLM": "mm_engine.llm",
    "AsyncLLM": "mm_engine.async_llm",
    "EngineConfig": "mm_engine.config",
    "SamplingParams": "mm_engine.sampling_params",
    "RequestOutputKind": "mm_engine.sampling_params",
    "RequestOutput": "mm_engine.outputs",
    "CompletionOutput": "mm_engine.outputs",
    "caption_images": "mm_engine.jobs.caption",
}

__all__ = [
    "LLM",
    "AsyncLLM",
    "EngineConfig",
    "SamplingParams",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "caption_images",
]

if TYPE_CHECKING:
    from mm_engine.async_llm import AsyncLLM
    from mm_engine.config import EngineConfig
    from mm_engine.jobs.caption import caption_images
    from mm_engine.llm import LLM
    from mm_engine.outputs import CompletionOutput, RequestOutput
    from mm_engine.sampling_params import RequestOutputKind, SamplingParams


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'mm_engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
