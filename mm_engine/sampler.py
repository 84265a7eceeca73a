"""Turn a batch of next-token logits into token ids: greedy, temperature, top-k, top-p.

Everything is vectorised over rows with per-row settings. Random rows are drawn with the
exponential-race trick: argmax(probs / q) with q ~ Exp(1) picks token i with probability probs[i].
Each row's noise comes from that row's own generator (or the global RNG when it has none), so a
seeded request gets the same tokens whatever else shares its batch and wherever it sits in it.
"""

from __future__ import annotations

import torch

from mm_engine.host_copy import to_device
from mm_engine.logit_adjust import RowContext, adjust_logits
from mm_engine.sampling_params import SamplingParams

GREEDY_BELOW = 1e-5


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
        return self.sample_tensor(logits, params, generators, rows).tolist()

    @torch.inference_mode()
    def sample_tensor(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        rows: list[RowContext] | None = None,
    ) -> torch.Tensor:
        """The sampled ids as a tensor `[batch]` on the logits' device, without waiting for them.
        `rows`: each row's tokens so far, needed when its params adjust the logits."""
        if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
            raise ValueError("sample() needs logits [batch, vocab] and one params and generator per row")
        logits = logits.float()
        if any(p.adjusts_logits for p in params):
            if rows is None or len(rows) != len(params):
                raise ValueError("these sampling params adjust the logits: pass each row's context")
            logits = adjust_logits(logits.clone(), params, rows)
        greedy_ids = logits.argmax(dim=-1)
        # A temperature this small only overflows the division; it means greedy (as in vLLM).
        greedy = [p.temperature < GREEDY_BELOW for p in params]
        if all(greedy):
            return greedy_ids

        device = logits.device
        temps = to_device(
            [p.temperature if p.temperature >= GREEDY_BELOW else 1.0 for p in params], None, device
        )
        probs = self._filtered_probs(logits / temps.unsqueeze(1), params)
        noise = self._exponential_noise(probs.shape, generators, device, self.generator)
        sampled_ids = (probs / noise).argmax(dim=-1)
        is_greedy = to_device(greedy, torch.bool, device)
        return torch.where(is_greedy, greedy_ids, sampled_ids)

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
