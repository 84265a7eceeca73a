"""The frontend's half of a step: token ids from the engine core become text and outputs.

Per request it keeps the detokenizer and what has been generated; for each `CoreOutput` it decodes
the new tokens, checks stop strings (a match ends the request here, and the caller aborts it in
the core, which does not see text), and builds the `RequestOutput` its `output_kind` asks for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from mm_engine.core.types import CoreOutput, TokenLogprobs
from mm_engine.frontend.detokenizer import IncrementalDetokenizer
from mm_engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from mm_engine.sampling_params import RequestOutputKind, SamplingParams


@dataclass(slots=True)
class _State:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    arrival_time: float
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer  # used on one thread only: the one that calls `process`
        self._states: dict[str, _State] = {}
        self._token_text: dict[int, str] = {}  # for logprobs: each token's own text

    def add(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
        arrival_time: float,
    ) -> None:  # fmt: skip
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
        self._states[request_id] = _State(prompt, prompt_token_ids, params, detok, arrival_time)

    def abort(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def process(self, core_outputs: list[CoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """The outputs to hand out, and the ids of requests a stop string ended, which the core
        must abort (it would otherwise go on generating them)."""
        outputs: list[RequestOutput] = []
        stopped: list[str] = []
        for co in core_outputs:
            st = self._states.get(co.request_id)
            if st is None:  # aborted while the step ran
                continue
            st.output_ids += co.new_token_ids
            if co.prompt_logprobs is not None:
                ids = st.prompt_token_ids
                st.prompt_logprobs = [None if lp is None else self._logprobs(ids[i], lp)
                                      for i, lp in enumerate(co.prompt_logprobs)]  # fmt: skip
            if co.logprobs:
                pairs = zip(co.new_token_ids, co.logprobs, strict=True)
                st.logprobs += [self._logprobs(t, lp) for t, lp in pairs]
                st.cumulative_logprob += sum(lp.logprob for lp in co.logprobs)
            detok = st.detokenizer
            reason, stop_reason = co.finish_reason, co.stop_token
            if co.ended_by_token:  # EOS or a stop token: not part of the text
                delta = detok.flush()
            else:
                delta = detok.step(co.new_token_ids)
                if detok.stopped:  # a stop string wins over length, which the core may have hit
                    if reason is None:
                        stopped.append(co.request_id)
                    reason, stop_reason = "stop", detok.stop_str
                elif reason is not None:
                    delta += detok.flush()
            if reason is not None:
                del self._states[co.request_id]
            out = self._output(co, st, delta, reason, stop_reason)
            if out is not None:
                outputs.append(out)
        return outputs, stopped

    def _logprobs(self, token: int, lp: TokenLogprobs) -> dict[int, Logprob]:
        entry = {token: Logprob(lp.logprob, lp.rank, self._text(token))}
        for rank, (t, value) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True), start=1):
            entry.setdefault(t, Logprob(value, rank, self._text(t)))
        return entry

    def _text(self, token: int) -> str:
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token])
        return text

    @staticmethod
    def _output(
        co: CoreOutput, st: _State, delta: str, reason: str | None, stop_reason: int | str | None
    ) -> RequestOutput | None:
        kind = st.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and reason is None:
            return None
        logprobs = None
        if kind is RequestOutputKind.DELTA:
            text, token_ids = delta, co.new_token_ids
            if st.params.logprobs is not None:
                logprobs = st.logprobs[len(st.output_ids) - len(co.new_token_ids) :]
        else:
            text, token_ids = st.detokenizer.text, list(st.output_ids)
            if st.params.logprobs is not None:
                logprobs = list(st.logprobs)
        finished = co.finished_time or (time.time() if reason is not None else None)  # by a stop string
        metrics = RequestMetrics(st.arrival_time, co.first_scheduled_time, co.first_token_time, finished)
        return RequestOutput(
            request_id=co.request_id,
            prompt=st.prompt,
            prompt_token_ids=st.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    0,
                    text,
                    token_ids,
                    reason,
                    stop_reason,
                    logprobs,
                    st.cumulative_logprob if logprobs is not None else None,
                )
            ],  # fmt: skip
            finished=reason is not None,
            metrics=metrics,
            num_cached_tokens=co.num_cached_tokens,
            delta_text=delta,
            # DELTA: in the first output only (the one that brings them).
            prompt_logprobs=st.prompt_logprobs if kind is not RequestOutputKind.DELTA or co.prompt_logprobs
            else None,
        )  # fmt: skip
