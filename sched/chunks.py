"""Where a request's next chunk ends: at the step's token budget, before an image the encoder
budget cannot take (or, with `sliced_encoding`, before an image whose tower is being run a share a
step, until it is done), and, for a model whose image tokens attend to each other in both directions
(Gemma 3, `whole_images`), never inside an image's run of embeddings (all of an image's keys must
be written before any of its queries runs)."""

from __future__ import annotations

from mm_engine.request import Request
from mm_engine.sched.step_pass import StepPass
from mm_engine.vision.encoder_cache import EncoderCache


def next_chunk(
    req: Request, p: StepPass, whole_images: bool, held_image: int | None, encoder_cache: EncoderCache
) -> tuple[int, int]:
    """Tokens `req` may compute now, and the image tokens to encode for them. `held_image`: the
    image its last chunk ended inside, whose features the runner holds (not charged again)."""
    start = req.num_computed_tokens
    n = min(req.num_tokens - start, p.budget)
    if start >= req.num_prompt_tokens:  # a decode, or output recomputed: no image to encode
        return n, 0
    if whole_images:
        n = not_inside_an_image(req, start, n)
    cost = 0
    for j, span in enumerate(req.images):
        if span.offset >= start + n:
            break
        if span.offset + span.length <= start or held_image == j:
            continue
        if encoder_cache.contains(span.content_hash):
            continue
        # Charged with what the tower produces (a tiled image's run also holds row/column tokens).
        left = p.encoder_left
        if p.encode_weight > 0.0:  # a time-bounded step: encoding spends the time prefill would
            left = min(left, int(max(0, p.budget - (span.offset - start)) / p.encode_weight))
        if cost + span.num_embeds > left:
            if not (p.one_image_free and cost == 0):
                return max(0, span.offset - start), cost  # stop before the image that does not fit
            if p.slicing:  # too big for this step: a share of its tower now, the chunk waits for it
                # (Not in a step of background work alone that prefills already: one kind of work.)
                if span.content_hash not in p.sliced and not (p.encode_alone and p.prefilled):
                    p.slice_image(req, j, left)
                return max(0, min(span.offset - start, p.budget)), cost
        if p.encode_alone and not whole_images:  # background: encoding is a step's prompt work
            if p.prefilled:
                return max(0, span.offset - start), cost  # this step prefills: the image waits
            # Up to the image's first token; one token when the chunk starts inside the image
            # (a cached prefix can end there after the encoder cache dropped its features).
            return min(n, max(1, span.offset - start + 1)), span.num_embeds
        cost += span.num_embeds
    return n, cost


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
