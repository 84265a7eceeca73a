"""Prompt logprobs: for a request that asks (`SamplingParams.prompt_logprobs=k`), each prompt
token's log probability given the tokens before it (raw logits, as vLLM reports them), its rank and
the top k, from the logits of the prompt rows a step computes (the runner appends those rows after
the sampled ones). Image positions get None: their ids are placeholders the model never predicts.
Such a request takes no prefix from the cache, since a cached prefix has no logits to give.
"""

from __future__ import annotations

import torch

from mm_engine.core.types import TokenLogprobs
from mm_engine.request import Request


def prompt_logprobs(
    items: list[tuple[Request, int]], rows: list[tuple[int, int, int]], logits: torch.Tensor
) -> None:
    """Append to each request's `prompt_logprobs` those of the positions `rows` names (item,
    first position, count; their logits in that order)."""
    at = 0
    for k, first, count in rows:
        req = items[k][0]
        lp = torch.log_softmax(logits[at : at + count].float(), dim=-1)
        at += count
        vocab = lp.shape[1]
        targets = req.token_ids[first + 1 : first + 1 + count]
        image = _image_positions(req, first + 1, first + 1 + count)
        safe = torch.tensor([t if 0 <= t < vocab else 0 for t in targets], device=lp.device)
        chosen = lp.gather(1, safe.unsqueeze(1)).squeeze(1)
        ranks = ((lp > chosen.unsqueeze(1)).sum(dim=-1) + 1).tolist()
        top_k = req.params.prompt_logprobs
        top_lp, top_ids = lp.topk(top_k, dim=-1) if top_k else (lp[:, :0], safe.unsqueeze(1)[:, :0])
        chosen, top_lp, top_ids = chosen.tolist(), top_lp.tolist(), top_ids.tolist()
        for i, t in enumerate(targets):
            if (first + 1 + i) in image or not 0 <= t < vocab:
                req.prompt_logprobs.append(None)
            else:
                req.prompt_logprobs.append(TokenLogprobs(chosen[i], ranks[i], top_ids[i], top_lp[i]))


def _image_positions(req: Request, lo: int, hi: int) -> set[int]:
    out = set()
    for span in req.images:
        for p in range(max(lo, span.offset), min(hi, span.offset + span.length)):
            if span.is_embed(p - span.offset):
                out.add(p)
    return out
