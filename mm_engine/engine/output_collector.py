"""One request's outputs on their way to its consumer, merged while the consumer is slow.

The engine sends deltas (the token and text new in a step); the collector keeps what the consumer
has not taken yet merged into one, so a client that reads slowly holds memory that grows with
its output, not with the square of it, and gets everything new in one piece when it reads. What
the consumer sees follows its `RequestOutputKind`: the merged delta, everything so far, or
nothing until the request finishes. Used on the consumer's event loop only.
"""

from __future__ import annotations

import asyncio
import dataclasses

from mm_engine.outputs import CompletionOutput, RequestOutput
from mm_engine.sampling_params import RequestOutputKind

DELTA, FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


class OutputCollector:
    def __init__(self, kind: RequestOutputKind) -> None:
        self.kind = kind
        self._last: RequestOutput | None = None  # the newest engine output not taken yet
        self._new_ids: list[int] = []  # since the consumer's previous output
        self._new_text: list[str] = []
        self._new_logprobs: list | None = None  # per token, where the request asked for them
        self._all_ids: list[int] = []  # since the start (not kept for DELTA)
        self._all_text = ""
        self._all_logprobs: list = []
        self._prompt_logprobs = None  # from the first output that has them
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        """Take one delta output from the engine."""
        self._last = out
        self._new_ids += out.outputs[0].token_ids
        self._new_text.append(out.delta_text)
        if out.prompt_logprobs is not None and self._prompt_logprobs is None:
            self._prompt_logprobs = out.prompt_logprobs
        if out.outputs[0].logprobs is not None:
            self._new_logprobs = (self._new_logprobs or []) + out.outputs[0].logprobs
        if self.kind is not FINAL_ONLY or out.finished:
            self._ready.set()

    def put_error(self, error: BaseException) -> None:
        """The request ended with `error`: the consumer gets what is pending first, then this."""
        self._error = error
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The next output for the consumer; raises the request's error once outputs are taken."""
        while True:
            await self._ready.wait()
            out = self._last
            if out is not None and (self.kind is not FINAL_ONLY or out.finished):
                self._last = None
                if self._error is None:
                    self._ready.clear()
                return self._build(out)
            if self._error is not None:
                raise self._error
            self._ready.clear()

    def _build(self, out: RequestOutput) -> RequestOutput:
        delta = "".join(self._new_text)
        new_ids, self._new_ids, self._new_text = self._new_ids, [], []
        new_lps, self._new_logprobs = self._new_logprobs, None
        if self.kind is DELTA:
            text, token_ids, logprobs = delta, new_ids, new_lps
        else:
            self._all_text += delta
            self._all_ids += new_ids
            self._all_logprobs += new_lps or []
            text, token_ids = self._all_text, list(self._all_ids)
            logprobs = None if new_lps is None and not self._all_logprobs else list(self._all_logprobs)
        c = out.outputs[0]
        completion = CompletionOutput(
            c.index, text, token_ids, c.finish_reason, c.stop_reason, logprobs, c.cumulative_logprob
        )
        prompt_lps = self._prompt_logprobs
        if self.kind is DELTA and prompt_lps is not None:
            self._prompt_logprobs = []  # given once, in the first delta
            prompt_lps = prompt_lps or None
        return dataclasses.replace(out, outputs=[completion], delta_text=delta, prompt_logprobs=prompt_lps)
