"""The state of one request as it moves through the engine. Plain data; the engine mutates it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from mm_engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class ImageSpan:
    """One image of a prompt: where its tokens sit and what to encode."""

    offset: int  # position of its first token in the prompt
    length: int  # tokens of its placeholder run (row/column/break tokens included)
    pixel_values: torch.Tensor  # preprocessed, in whatever shape the family's tower takes
    content_hash: str
    embed_mask: tuple[bool, ...] | None = None  # which run positions carry embeddings; None: all
    num_embeds: int = -1  # embeddings the tower produces (-1: one per run position)
    grid: tuple[int, ...] | None = None  # the family's patch grid, where it has one (Qwen: t, h, w)
    temporal_step: float = 1.0  # M-RoPE time positions per temporal patch (a video's; models/interface.py)
    video: bool = False  # a clip's frames rather than an image
    time_offset: int = 0  # a clip's group of temporal patches: its first patch within the clip

    def __post_init__(self) -> None:
        if self.num_embeds < 0:
            self.num_embeds = self.length if self.embed_mask is None else sum(self.embed_mask)

    def embed_runs(self) -> list[tuple[int, int]]:
        """Prompt positions `[lo, hi)` of each contiguous run of embedding positions (one for most
        images; Gemma 3's pan-and-scan crops each have their own)."""
        mask = self.embed_mask or (True,) * self.length
        runs, lo = [], None
        for i, m in enumerate((*mask, False)):
            if m and lo is None:
                lo = i
            elif not m and lo is not None:
                runs.append((self.offset + lo, self.offset + i))
                lo = None
        return runs

    def is_embed(self, i: int) -> bool:
        """Does run position `i` carry a vision embedding?"""
        return self.embed_mask is None or self.embed_mask[i]


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    images: list[ImageSpan]
    params: SamplingParams
    arrival_time: float
    seq_no: int  # arrival order, the tie-breaker of every policy
    eos_token_ids: frozenset[int]
    prompt: str | None = None
    priority: int = 0
    token_ids: list[int] = field(default_factory=list)  # prompt then output
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # content hash of each full block
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache
    num_cached_tokens: int = 0  # prompt tokens taken from cached KV at first admission
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None
    grammar: Any = None  # its GrammarState (structured output), once compiled
    logit_state: Any = None  # its LogitState (logit_bias, penalties ... as tensors), once sampled
    prompt_logprobs: list = field(default_factory=list)  # prompt positions 1.. so far (if asked)
    # Multimodal rotary positions of the prompt ([3, prompt tokens], Qwen line), set once when the
    # request is added; token i >= the prompt sits at i + mrope_delta on all three axes.
    mrope_positions: torch.Tensor | None = None
    mrope_delta: int = 0
    num_preemptions: int = 0
    state_slot: int | None = None  # hybrid models: its slot in the recurrent-state pool, while running
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def has_images(self) -> bool:
        return bool(self.images)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
