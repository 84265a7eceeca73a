"""Whether a request ends with the token just appended to it, and why: the core's stop rules."""

from __future__ import annotations

from mm_engine.request import Request


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
