"""mm-engine: a multimodal (vision-language) LLM serving engine."""

from mm_engine.caption import caption_images
from mm_engine.llm import LLM
from mm_engine.outputs import CompletionOutput, RequestOutput
from mm_engine.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "caption_images",
]
