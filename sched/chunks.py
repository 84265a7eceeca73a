"""Where a prefill chunk may end, for a model whose image tokens attend to each other in both
directions (Gemma 3, `whole_images`): all of an image's keys must be written before any of its
queries runs, so a chunk never ends inside an image's run of embeddings."""

from __future__ import annotations

from mm_engine.request import Request


def not_inside_an_image(req: Request, start: int, n: int) -> int:
    """`n` cut so that the chunk does not end inside an image: to the image's start, or to
    nothing when the chunk would start there (the image then waits for a step whose budget
    holds it whole; `check_fits` made sure one can)."""
    end = start + n
    if start >= req.num_prompt_tokens:  # a decode, or output recomputed: no image ahead
        return n
    for span in req.images:
        if span.offset + span.length <= start or span.offset >= end:
            continue
        for lo, hi in span.embed_runs():  # a pan-and-scan image may split between its crops
            if lo < end < hi:
                return max(0, lo - start)
    return n
