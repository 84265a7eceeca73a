"""What changes a batch's next-token logits before temperature: allowed_token_ids, min_tokens,
logit_bias and the repetition, frequency and presence penalties (vLLM's meanings and order),
batched on the logits' device from each request's `LogitState` (its tensors, made once): one
concatenation and scatter per kind per step, no loop over the vocabulary or a request's lists.

- allowed_token_ids: every other token gets -inf;
- min_tokens: EOS and the stop token ids get -inf until the output has that many tokens;
- bad_words: a one-token word gets -inf; a longer one's last token gets -inf right after the
  output ends with the rest of it (vLLM's);
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

from mm_engine.core.logit_state import LogitState
from mm_engine.core.structured_output import apply_bitmask, fill_allowed
from mm_engine.kernels.host_copy import to_device
from mm_engine.sampling_params import SamplingParams


@dataclass(slots=True)
class RowContext:
    """What a row's adjustments read, taken when the step is launched (the request's own lists
    change meanwhile): its request's tensors, the output so far where they track it, and the ids
    that end it."""

    num_output: int
    stop_ids: frozenset[int]  # EOS and stop_token_ids
    state: LogitState
    output: torch.Tensor | None = None  # [n] int64, the output ids so far, where `state` tracks them
    allowed: torch.Tensor | None = None  # a grammar's bitmask of the tokens allowed next (xgrammar's)

    @classmethod
    def of(
        cls, token_ids: list[int], num_prompt: int, stop_ids: frozenset[int], params: SamplingParams,
        state: LogitState | None = None, vocab: int | None = None,
    ) -> RowContext:  # fmt: skip
        """`state`: the request's, made once (a fresh one when None)."""
        state = state if state is not None else LogitState.of(params, token_ids[:num_prompt], vocab)
        output = state.snapshot(token_ids, num_prompt)
        return cls(len(token_ids) - num_prompt, stop_ids, state, output)


def row_contexts(reqs: list, vocab_size: int) -> list[RowContext] | None:
    """What the adjustments of these requests' rows read, where any row has one (None: none).
    A request's `LogitState` is made the first time it is read and kept on the request."""
    if not any(r.params.adjusts_logits for r in reqs):
        return None
    rows = []
    for r in reqs:
        if r.logit_state is None:
            r.logit_state = LogitState.of(r.params, r.prompt_token_ids, vocab_size)
        stops = r.eos_token_ids | set(r.params.stop_token_ids)
        rows.append(RowContext.of(r.token_ids, r.num_prompt_tokens, stops, r.params, r.logit_state))
    fill_allowed(reqs, rows, vocab_size)
    return rows


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams], rows: list[RowContext]) -> torch.Tensor:
    """`logits` [batch, vocab] (float32, changed in place where it helps) with every row's
    adjustments applied."""
    vocab, dev = logits.shape[1], logits.device
    on = [row.state.on(dev) for row in rows]
    only = [i for i, c in enumerate(on) if c["allowed_ids"] is not None]
    if only:
        keep = torch.zeros((len(only), vocab), dtype=torch.bool, device=dev)
        keep[_pairs([on[i]["allowed_ids"] for i in only], range(len(only)), dev)] = True
        at = to_device(only, torch.long, dev)
        logits[at] = logits.index_select(0, at).masked_fill(~keep, float("-inf"))
    biased = [i for i, c in enumerate(on) if c["bias_ids"] is not None]
    if biased:
        values = torch.cat([on[i]["bias_values"] for i in biased])
        logits.index_put_(_pairs([on[i]["bias_ids"] for i in biased], biased, dev), values, accumulate=True)
    masked: list[tuple[int, int]] = []  # (row, token) -> -inf
    for i, (p, row) in enumerate(zip(params, rows, strict=True)):
        if p.min_tokens and row.num_output < p.min_tokens:
            masked.extend((i, t) for t in row.stop_ids if t < vocab)
        masked.extend((i, t) for t in row.state.banned_after(row.output))
    if masked:
        r, t = zip(*masked, strict=True)
        logits[to_device(r, torch.long, dev), to_device(t, torch.long, dev)] = float("-inf")
    banned = [i for i, c in enumerate(on) if c["bad_single"] is not None]
    if banned:
        logits[_pairs([on[i]["bad_single"] for i in banned], banned, dev)] = float("-inf")
    constrained = [i for i, row in enumerate(rows) if row.allowed is not None]
    if constrained:
        at = to_device(constrained, torch.long, dev)
        sub = logits.index_select(0, at)
        apply_bitmask(sub, torch.stack([rows[i].allowed for i in constrained]))
        logits[at] = sub
    penalised = [i for i, p in enumerate(params) if p.penalised]
    if penalised:
        _penalise(logits, penalised, [params[i] for i in penalised], [rows[i] for i in penalised])
    return logits


def _pairs(ids: list[torch.Tensor], rows, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) tensors for advanced indexing: row `rows[j]` with each id of `ids[j]`."""
    counts = to_device([x.numel() for x in ids], torch.long, device)
    at = torch.repeat_interleave(to_device(list(rows), torch.long, device), counts)
    return at, torch.cat(ids).to(device)


def _penalise(logits: torch.Tensor, at: list[int], params: list[SamplingParams], rows: list[RowContext]):
    """The penalties of rows `at`, in place, touching only the tokens each row has seen: a token is
    a key row * (vocab + 1) + id, the keys sorted and counted once (no [rows, vocab] scratch)."""
    vocab, dev = logits.shape[1], logits.device
    width = vocab + 1
    out_keys, counts = torch.unique(_keys([row.output for row in rows], at, width), return_counts=True)
    reps = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in reps):
        prompt_keys = _keys([row.state.prompt_ids for row in rows], at, width)
        seen = torch.unique(torch.cat([out_keys, prompt_keys])).to(dev)
        r, t = seen // width, seen % width
        rep = _per_row(reps, at, dev)[r]
        v = logits[r, t]
        logits[r, t] = torch.where(v > 0, v / rep, v * rep)
    out_keys, counts = out_keys.to(dev), counts.to(dev, torch.float32)
    r, t = out_keys // width, out_keys % width
    freq = _per_row([p.frequency_penalty for p in params], at, dev)[r]
    pres = _per_row([p.presence_penalty for p in params], at, dev)[r]
    logits[r, t] -= freq * counts + pres


def _keys(ids: list[torch.Tensor | None], at: list[int], width: int) -> torch.Tensor:
    """Each row's ids (on the host) as keys row * width + id; ids outside the vocabulary (image
    placeholders of some families, a token still in flight) count nowhere."""
    keys = [x[(x >= 0) & (x < width - 1)] + i * width for x, i in zip(ids, at, strict=True) if x is not None]
    return torch.cat(keys) if keys else torch.empty(0, dtype=torch.long)


def _per_row(values: list[float], at: list[int], device: torch.device) -> torch.Tensor:
    """`values[j]` at index `at[j]`, so that a key's row picks its row's value."""
    out = torch.zeros(max(at) + 1, dtype=torch.float32)
    out[torch.tensor(at)] = torch.tensor(values, dtype=torch.float32)
    return out.to(device)
