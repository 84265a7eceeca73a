"""A request's logit adjustments as tensors, made once per request (vLLM's logits-processor shape):
each step then costs a concatenation and a scatter, not a loop over the request's lists.

What a step reads of it is fixed when the step is launched: `snapshot()` returns views of the
output so far that later appends cannot change (they land past the view's end, or in a new buffer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mm_engine.sampling_params import SamplingParams

_FIRST_CAPACITY = 64


@dataclass(slots=True)
class LogitState:
    bias_ids: torch.Tensor | None  # [k] int64: logit_bias's tokens inside the vocabulary
    bias_values: torch.Tensor | None  # [k] float32
    allowed_ids: torch.Tensor | None  # [k] int64: allowed_token_ids inside the vocabulary
    prompt_ids: torch.Tensor | None  # [k] int64: the prompt's distinct ids (repetition penalty)
    bad_single: torch.Tensor | None  # [k] int64: one-token bad words, banned at every step
    bad_multi: list[tuple[tuple[int, ...], int]]  # (prefix, last token): banned after the prefix
    tracks_output: bool  # whether the output so far is kept (penalties, multi-token bad words)
    _out: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    num_out: int = 0  # output ids copied into _out so far
    _on_device: dict = field(default_factory=dict)  # device -> the constant tensors there

    @classmethod
    def of(cls, params: SamplingParams, prompt_ids: list[int], vocab: int | None = None) -> LogitState:
        """`vocab`: ids at or past it are dropped (admission refuses them; a test may pass None)."""
        vocab = vocab if vocab is not None else 2**63 - 1
        bias = {t: b for t, b in (params.logit_bias or {}).items() if t < vocab}
        allowed = [t for t in params.allowed_token_ids or () if t < vocab]
        bad = [tuple(w) for w in params.bad_words_token_ids or () if all(t < vocab for t in w)]
        single = sorted({w[0] for w in bad if len(w) == 1})
        multi = sorted({(w[:-1], w[-1]) for w in bad if len(w) > 1})
        prompt = None
        if params.repetition_penalty != 1.0:
            ids = torch.tensor(prompt_ids, dtype=torch.long)
            prompt = torch.unique(ids[(ids >= 0) & (ids < vocab)])  # image placeholders count nowhere
        return cls(
            bias_ids=torch.tensor(list(bias), dtype=torch.long) if bias else None,
            bias_values=torch.tensor(list(bias.values()), dtype=torch.float32) if bias else None,
            allowed_ids=torch.tensor(allowed, dtype=torch.long) if params.allowed_token_ids else None,
            prompt_ids=prompt,
            bad_single=torch.tensor(single, dtype=torch.long) if single else None,
            bad_multi=multi,
            tracks_output=params.penalised or bool(multi),
        )

    def snapshot(self, token_ids: list[int], num_prompt: int) -> torch.Tensor | None:
        """The output ids so far ([n] int64, a view fixed from now on), after copying in the ones
        appended since the last call; None where nothing reads them. A placeholder (a token still
        in flight, negative) ends the copy: it is read once it is known."""
        if not self.tracks_output:
            return None
        new = token_ids[num_prompt + self.num_out :]
        end = next((i for i, t in enumerate(new) if t < 0), len(new))
        if end:
            need = self.num_out + end
            if need > self._out.numel():  # a new buffer: views already handed out keep the old one
                grown = torch.empty(max(need, 2 * self._out.numel(), _FIRST_CAPACITY), dtype=torch.long)
                grown[: self.num_out] = self._out[: self.num_out]
                self._out = grown
            self._out[self.num_out : need] = torch.tensor(new[:end], dtype=torch.long)
            self.num_out = need
        return self._out[: self.num_out]

    def banned_after(self, output: torch.Tensor | None) -> list[int]:
        """The last tokens of multi-token bad words whose prefix ends the output so far."""
        if not self.bad_multi or output is None:
            return []
        tail = output[-max(len(p) for p, _ in self.bad_multi) :].tolist()
        ends = [(prefix, last) for prefix, last in self.bad_multi if len(prefix) <= len(tail)]
        return [last for prefix, last in ends if tail[-len(prefix) :] == list(prefix)]

    def on(self, device: torch.device) -> dict[str, torch.Tensor | None]:
        """The constant tensors on `device`, copied there once."""
        if device not in self._on_device:
            names = ("bias_ids", "bias_values", "allowed_ids", "bad_single")  # prompt ids stay on the host
            self._on_device[device] = {
                n: None if getattr(self, n) is None else getattr(self, n).to(device) for n in names
            }
        return self._on_device[device]
