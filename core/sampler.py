"""Turn a batch of next-token logits into token ids: greedy, temperature, top-k, top-p.

Everything is vectorised over rows with per-row settings. Random rows are drawn with the
exponential-race trick: argmax(probs / q) with q ~ Exp(1) picks token i with probability probs[i].
Each row's noise comes from that row's own generator (or the global RNG when it has none), so a
seeded request gets the same tokens whatever else shares its batch and wherever it sits in it.

Rows that ask for logprobs get them from the logits the sample was drawn from: after the logit
adjustments and temperature (1 for greedy rows), before top-k/top-p/min_p (as OpenAI reports them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mm_engine.core.logit_adjust import RowContext, adjust_logits
from mm_engine.core.types import TokenLogprobs
from mm_engine.kernels.host_copy import to_device
from mm_engine.sampling_params import SamplingParams

GREEDY_BELOW = 1e-5
# The id of a row whose adjustments left no token allowed (a grammar that needs a token that
# `allowed_token_ids` or `bad_words` forbid, `min_tokens` over an allowed set of stop tokens): the
# core ends that request instead of sampling from nothing.
NO_TOKEN = -1
MAX_LOGPROBS = 20  # top logprobs per token at most (OpenAI's limit)


@dataclass(slots=True)
class Sampled:
    """One step's samples, on the device: ids `[batch]`; where a row asked for logprobs, the
    sampled token's logprob and rank (1 = the most likely) and the top `max_k` alternatives."""

    ids: torch.Tensor
    logprobs: torch.Tensor | None = None  # [batch]
    ranks: torch.Tensor | None = None  # [batch]
    top_ids: torch.Tensor | None = None  # [batch, max_k]
    top_logprobs: torch.Tensor | None = None  # [batch, max_k]

    def host_logprobs(self, params: list[SamplingParams]) -> list[TokenLogprobs | None]:
        """Per row, what it asked for, as plain values (waits for the device)."""
        if self.logprobs is None:
            return [None] * len(params)
        lps, ranks = self.logprobs.tolist(), self.ranks.tolist()
        top_ids, top_lps = self.top_ids.tolist(), self.top_logprobs.tolist()
        out: list[TokenLogprobs | None] = []
        for i, p in enumerate(params):
            k = p.logprobs
            out.append(None if k is None else TokenLogprobs(lps[i], ranks[i], top_ids[i][:k], top_lps[i][:k]))
        return out


class Sampler:
    def __init__(self, generator: torch.Generator | None = None) -> None:
        # Unseeded rows draw from this (the engine's own, seeded from its config) rather than
        # torch's process-wide RNG, which a library must leave to its caller.
        self.generator = generator

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        rows: list[RowContext] | None = None,
    ) -> list[int]:
        return self.sample_tensor(logits, params, generators, rows).ids.tolist()

    @torch.inference_mode()
    def sample_tensor(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        rows: list[RowContext] | None = None,
    ) -> Sampled:
        """The samples as tensors on the logits' device, without waiting for them.
        `rows`: each row's tokens so far, needed when its params adjust the logits."""
        if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
            raise ValueError("sample() needs logits [batch, vocab] and one params and generator per row")
        logits = logits.float()
        if any(p.adjusts_logits for p in params):
            if rows is None or len(rows) != len(params):
                raise ValueError("these sampling params adjust the logits: pass each row's context")
            logits = adjust_logits(logits.clone(), params, rows)
            empty = logits.amax(dim=-1) == float("-inf")
            sampled = self._sample(logits, params, generators)
            sampled.ids = sampled.ids.masked_fill(empty, NO_TOKEN)
            return sampled
        return self._sample(logits, params, generators)

    def _sample(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> Sampled:
        greedy_ids = logits.argmax(dim=-1)
        # A temperature this small only overflows the division; it means greedy (as in vLLM).
        greedy = [p.temperature < GREEDY_BELOW for p in params]
        wants_logprobs = any(p.logprobs is not None for p in params)
        if all(greedy) and not wants_logprobs:
            return Sampled(greedy_ids)
        device = logits.device
        temps = to_device(
            [p.temperature if p.temperature >= GREEDY_BELOW else 1.0 for p in params], None, device
        )
        scaled = logits / temps.unsqueeze(1)
        if all(greedy):
            ids = greedy_ids
        else:
            probs = self._filtered_probs(scaled, params)
            noise = self._exponential_noise(probs.shape, generators, device, self.generator)
            sampled_ids = (probs / noise).argmax(dim=-1)
            ids = torch.where(to_device(greedy, torch.bool, device), greedy_ids, sampled_ids)
        if not wants_logprobs:
            return Sampled(ids)
        return self._with_logprobs(ids, scaled, max(p.logprobs or 0 for p in params))

    @staticmethod
    def _with_logprobs(ids: torch.Tensor, scaled: torch.Tensor, max_k: int) -> Sampled:
        lp = torch.log_softmax(scaled, dim=-1)
        chosen = lp.gather(1, ids.unsqueeze(1)).squeeze(1)
        ranks = (lp > chosen.unsqueeze(1)).sum(dim=-1) + 1
        top_lp, top_ids = lp.topk(max_k, dim=-1) if max_k else (lp[:, :0], ids.unsqueeze(1)[:, :0])
        return Sampled(ids, chosen, ranks, top_ids, top_lp)

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Softmax after masking what top-k and top-p cut (both off: a plain softmax)."""
        batch, vocab = logits.shape
        # Off is encoded so that it never masks: k = vocab, p > 1 (a cumulative sum that rounds
        # to 1.0 before the end must not cut the tail of a row that asked for no top-p).
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        ps = [p.top_p if p.top_p < 1.0 else 2.0 for p in params]
        min_ps = [p.min_p for p in params]
        if any(m > 0.0 for m in min_ps):  # tokens below min_p times the row's top probability go
            probs = torch.softmax(logits, dim=-1)
            min_p = to_device(min_ps, torch.float32, logits.device).unsqueeze(1)
            floor = min_p * probs.amax(dim=-1, keepdim=True)
            logits = logits.masked_fill(probs < floor, float("-inf"))
        if all(k == vocab for k in ks) and all(p > 1.0 for p in ps):
            return torch.softmax(logits, dim=-1)

        device = logits.device
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(vocab, device=device).expand(batch, vocab)
        cut = rank >= to_device(ks, torch.long, device).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Keep a token while the mass strictly before it is below top_p: the smallest set that
        # reaches top_p, and always the top token (mass before it is 0).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        cut |= mass_before >= to_device(ps, torch.float32, device).unsqueeze(1)
        cut[:, 0] = False  # a top_p that underflows float32 to 0 must still keep the best token
        removed = torch.zeros_like(cut).scatter_(1, order, cut)
        return torch.softmax(logits.masked_fill(removed, float("-inf")), dim=-1)

    @staticmethod
    def _exponential_noise(
        shape: torch.Size, generators: list[torch.Generator | None], device: torch.device,
        default: torch.Generator | None = None,
    ) -> torch.Tensor:  # fmt: skip
        noise = torch.empty(shape, device=device)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            where = default.device if default is not None else device
            drawn = torch.empty((len(unseeded), shape[1]), device=where).exponential_(generator=default)
            noise[to_device(unseeded, torch.long, device)] = (
                to_device(drawn, None, device) if drawn.device != device else drawn
            )
        for i, g in enumerate(generators):
            if g is not None:
                # Draw on the generator's own device so its stream does not depend on where logits live.
                row = torch.empty(shape[1], device=g.device).exponential_(generator=g)
                noise[i] = to_device(row, None, device) if row.device != device else row
        # Exp(1) can round to 0; 0/0 would be NaN, which argmax would pick over everything.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)
