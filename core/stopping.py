"""A sampled token onto its request: appended (its first-token time, logprobs, grammar), and whether
the request ends with it, and why: the core's stop rules."""

from __future__ import annotations

import logging

from mm_engine.core.sampler import NO_TOKEN
from mm_engine.core.types import CoreOutput, TokenLogprobs
from mm_engine.request import Request

logger = logging.getLogger("mm_engine.core")


def append_sampled(
    req: Request, token: int, now: float, lp: TokenLogprobs | None, max_model_len: int
) -> tuple[CoreOutput, str | None]:
    """The request's output for the token sampled for it, and the reason it ends with it (None:
    it goes on; the caller finishes it, and fills in the output's finish fields after)."""
    out = CoreOutput(req.request_id, [], num_cached_tokens=req.num_cached_tokens)
    if token == NO_TOKEN:  # its adjustments left nothing to sample: it ends, with what it has
        logger.warning(
            "request %s: no token is allowed at output %d (the grammar, allowed_token_ids, "
            "bad_words and min_tokens together exclude every token); ended",
            req.request_id, req.num_tokens - req.num_prompt_tokens,
        )  # fmt: skip
        return out, "abort"
    req.token_ids.append(token)
    out.new_token_ids.append(token)
    if req.first_token_time is None:
        req.first_token_time = now
        if req.params.prompt_logprobs is not None:
            out.prompt_logprobs, req.prompt_logprobs = [None, *req.prompt_logprobs], []
    if lp is not None:
        out.logprobs = [lp]
    if req.grammar is not None:
        req.grammar.accept(token)
    reason, out.stop_token, out.ended_by_token = ends_after(req, token, max_model_len)
    return out, reason


def ends_after(req: Request, token: int, max_model_len: int) -> tuple[str | None, int | None, bool]:
    """(finish reason or None, the stop token that ended it, whether the token itself ended it):
    an end-of-sequence or `stop_token_ids` token stops it; `max_tokens` outputs or
    `max_model_len` tokens end it by length; a grammar that has accepted its stop token (with
    `ignore_eos`) stops it too."""
    if token in req.eos_token_ids or token in req.params.stop_token_ids:
        return "stop", token if token in req.params.stop_token_ids else None, True
    if req.num_tokens - req.num_prompt_tokens >= req.params.max_tokens or req.num_tokens >= max_model_len:
        return "length", None, False
    if req.grammar is not None and req.grammar.terminated:
        return "stop", None, False
    return None, None, False
