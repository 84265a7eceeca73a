"""What changes a batch's next-token logits before temperature: allowed_token_ids, min_tokens,
logit_bias and the repetition, frequency and presence penalties (vLLM's meanings and order),
batched on the logits' device: one padded id tensor per kind, no loop over the vocabulary.

- allowed_token_ids: every other token gets -inf;
- min_tokens: EOS and the stop token ids get -inf until the output has that many tokens;
- logit_bias: added to the token's logit;
- repetition_penalty r: a token seen in the prompt or the output has its logit divided by r when
  positive, multiplied by r when not;
- frequency_penalty f and presence_penalty p: a token's logit loses f times its count in the
  output, and p once it is there;
- structured output: tokens the request's grammar does not allow next get -inf (last, so that no
  bias can bring one back).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mm_engine.core.structured_output import apply_bitmask, fill_allowed
from mm_engine.kernels.host_copy import to_device
from mm_engine.sampling_params import SamplingParams


@dataclass(slots=True)
class RowContext:
    """What a row's adjustments read, taken when the step is launched (the request's own lists
    change meanwhile): its tokens so far (only where a penalty reads them) and the ids that end it."""

    prompt_ids: list[int]
    output_ids: list[int]
    num_output: int
    stop_ids: frozenset[int]  # EOS and stop_token_ids
    allowed: torch.Tensor | None = None  # a grammar's bitmask of the tokens allowed next (xgrammar's)

    @classmethod
    def of(cls, token_ids: list[int], num_prompt: int, stop_ids: frozenset[int], params: SamplingParams):
        if not params.penalised:
            return cls([], [], len(token_ids) - num_prompt, stop_ids)
        prompt = token_ids[:num_prompt] if params.repetition_penalty != 1.0 else []
        return cls(prompt, token_ids[num_prompt:], len(token_ids) - num_prompt, stop_ids)


def row_contexts(reqs: list, vocab_size: int) -> list[RowContext] | None:
    """What the adjustments of these requests' rows read, where any row has one (None: none)."""
    if not any(r.params.adjusts_logits for r in reqs):
        return None
    rows = [
        RowContext.of(
            r.token_ids, r.num_prompt_tokens, r.eos_token_ids | set(r.params.stop_token_ids), r.params
        )
        for r in reqs
    ]
    fill_allowed(reqs, rows, vocab_size)
    return rows


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams], rows: list[RowContext]) -> torch.Tensor:
    """`logits` [batch, vocab] (float32, changed in place where it helps) with every row's
    adjustments applied."""
    vocab, dev = logits.shape[1], logits.device
    only = [(i, p.allowed_token_ids) for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if only:
        keep = torch.zeros((len(only), vocab), dtype=torch.bool, device=dev)
        rows_at = [j for j, (_, ids) in enumerate(only) for t in ids if t < vocab]
        ids_at = [t for _, ids in only for t in ids if t < vocab]
        keep[to_device(rows_at, torch.long, dev), to_device(ids_at, torch.long, dev)] = True
        at = to_device([i for i, _ in only], torch.long, dev)
        logits[at] = logits.index_select(0, at).masked_fill(~keep, float("-inf"))
    masked: list[tuple[int, int]] = []  # (row, token) -> -inf
    biased: list[tuple[int, int, float]] = []
    for i, (p, row) in enumerate(zip(params, rows, strict=True)):
        if p.min_tokens and row.num_output < p.min_tokens:
            masked.extend((i, t) for t in row.stop_ids if t < vocab)
        if p.logit_bias:
            biased.extend((i, t, b) for t, b in p.logit_bias.items() if t < vocab)
    if biased:
        r, t, b = zip(*biased, strict=True)
        at = (to_device(r, torch.long, dev), to_device(t, torch.long, dev))
        logits.index_put_(at, to_device(b, torch.float32, dev), accumulate=True)
    if masked:
        r, t = zip(*masked, strict=True)
        logits[to_device(r, torch.long, dev), to_device(t, torch.long, dev)] = float("-inf")
    constrained = [i for i, row in enumerate(rows) if row.allowed is not None]
    if constrained:
        at = to_device(constrained, torch.long, dev)
        sub = logits.index_select(0, at)
        apply_bitmask(sub, torch.stack([rows[i].allowed for i in constrained]))
        logits[at] = sub
    penalised = [i for i, p in enumerate(params) if p.penalised]
    if penalised:
        at = to_device(penalised, torch.long, dev)
        logits[at] = _penalise(
            logits.index_select(0, at), [params[i] for i in penalised], [rows[i] for i in penalised]
        )
    return logits


def _penalise(logits: torch.Tensor, params: list[SamplingParams], rows: list[RowContext]) -> torch.Tensor:
    vocab, dev = logits.shape[1], logits.device
    counts = _bincount([row.output_ids for row in rows], vocab, dev)  # [rows, vocab] float
    reps = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in reps):
        seen = (counts > 0) | (_bincount([row.prompt_ids for row in rows], vocab, dev) > 0)
        rep = to_device(reps, torch.float32, dev).unsqueeze(1)
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    freq = to_device([p.frequency_penalty for p in params], torch.float32, dev).unsqueeze(1)
    pres = to_device([p.presence_penalty for p in params], torch.float32, dev).unsqueeze(1)
    return logits - freq * counts - pres * (counts > 0).float()


def _bincount(ids: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Per row, how often each token id occurs in its list: [rows, vocab] float32."""
    width = max(1, max(len(x) for x in ids))
    padded = [x + [vocab] * (width - len(x)) for x in ids]  # the pad lands in an extra column
    index = to_device(padded, torch.long, device)
    # Ids outside the vocabulary (image placeholders of some families) count nowhere.
    index = torch.where((index < 0) | (index > vocab), vocab, index)
    counts = torch.zeros((len(ids), vocab + 1), device=device)
    counts.scatter_add_(1, index, torch.ones(index.shape, device=device))
    return counts[:, :vocab]
