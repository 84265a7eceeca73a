"""Starting a step's forward and sampling without waiting for its tokens (overlapped scheduling).

    launch(inputs, prev) -> Launched          Launched.token_ids() -> list[int]   (the one wait)

A launched step may take input ids that the step before it sampled and has not handed back yet
(`StepInputs.from_prev`): they are copied from that step's sampled tokens in launch order, so the
host never has to read them first. Two ways to run a launch:
- `inline`: on the calling thread. On CUDA this only queues the kernels: the sampled tokens are
  copied into pinned host memory behind them and an event marks when they are there; on a CPU it
  runs to completion at once (no overlap: the order of events is the same, which tests rely on).
- `thread`: one worker thread runs every launch in order (torch releases the GIL inside its ops,
  so on a CPU the host prepares the next step while this one computes).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from mm_engine.core.logit_adjust import RowContext
from mm_engine.core.model_runner import ModelRunner, StepInputs
from mm_engine.core.sampler import Sampled, Sampler
from mm_engine.core.types import TokenLogprobs
from mm_engine.sampling_params import SamplingParams

LAUNCH_MODES = ("inline", "thread")


@dataclass(slots=True, eq=False)
class Launched:
    """One step whose forward is under way: what it holds and, once done, what it sampled."""

    items: list  # the scheduled (request, new tokens) pairs
    sampling: list[int]  # indices into `items` of the requests that sample
    tokens: Future  # what it sampled (Sampled, on the device; None when nothing samples)
    host: torch.Tensor | None = None  # pinned copy of the tokens (CUDA inline)
    ready: torch.cuda.Event | None = field(default=None)  # recorded after that copy
    host_logprobs: Sampled | None = None  # pinned copies of the logprob tensors (CUDA inline)
    registered: list = field(default_factory=list)  # (request, blocks registered before) by settling
    background_only: bool = False  # its batch ran background work alone (read before the next)

    def device_tokens(self) -> torch.Tensor | None:
        """The sampled ids on the device (in thread mode: waits for the step; in launch order
        they are always done by the time a later launch asks)."""
        sampled = self.tokens.result()
        return None if sampled is None else sampled.ids

    def token_ids(self) -> list[int]:
        """The sampled ids on the host: the point where the host waits for the device."""
        sampled = self.tokens.result()
        if sampled is None:
            return []
        if self.ready is not None:
            self.ready.synchronize()
            return self.host.tolist()
        return sampled.ids.tolist()

    def logprobs(self) -> list[TokenLogprobs | None]:
        """Per sampling row, the logprobs it asked for (after `token_ids`)."""
        sampled = self.tokens.result()
        if sampled is None:
            return []
        params = [self.items[k][0].params for k in self.sampling]
        return (self.host_logprobs or sampled).host_logprobs(params)

    def wait(self) -> None:
        """Wait until the step has run, without reading (or raising) anything."""
        with contextlib.suppress(Exception):  # whoever reads the tokens sees the failure
            self.token_ids()


class StepLauncher:
    def __init__(self, runner: ModelRunner, sampler: Sampler, device: torch.device, mode: str) -> None:
        if mode not in LAUNCH_MODES:
            raise ValueError(f"launch mode must be one of {', '.join(LAUNCH_MODES)}; got {mode!r}")
        self.runner = runner
        self.sampler = sampler
        self.device = device
        self.mode = mode
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="mm-forward") if mode == "thread" else None

    @property
    def concurrent(self) -> bool:
        """Whether a launched step may still be computing on the host while the caller goes on."""
        return self._worker is not None

    def launch(
        self,
        items: list,
        inputs: StepInputs,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        prev: Launched | None,
        rows: list[RowContext] | None = None,
    ) -> Launched:
        if self._worker is not None:
            future = self._worker.submit(self._run, inputs, params, generators, prev, rows)
            return Launched(items, inputs.sampling, future)
        future: Future = Future()
        try:
            tokens = self._run(inputs, params, generators, prev, rows)
        except Exception as exc:  # noqa: BLE001 - surfaces where the tokens are read, as in thread mode
            future.set_exception(exc)
            return Launched(items, inputs.sampling, future)
        future.set_result(tokens)
        if tokens is None or self.device.type != "cuda":
            return Launched(items, inputs.sampling, future)
        host = _pinned(tokens.ids)
        host_lps = None
        if tokens.logprobs is not None:  # read with the tokens, behind the same event
            lps = (tokens.logprobs, tokens.ranks, tokens.top_ids, tokens.top_logprobs)
            host_lps = Sampled(host, *(_pinned(t) for t in lps))
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        return Launched(items, inputs.sampling, future, host, ready, host_lps)

    def _run(
        self,
        inputs: StepInputs,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        prev: Launched | None,
        rows: list[RowContext] | None,
    ) -> Sampled | None:
        prev_tokens = prev.device_tokens() if prev is not None and inputs.from_prev is not None else None
        logits, sampling = self.runner.forward(inputs, prev_tokens)
        if not sampling:
            return None
        return self.sampler.sample_tensor(logits, params, generators, rows)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of `t`, queued behind the work that makes it."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def make_launcher(config, runner: ModelRunner, sampler: Sampler, device: torch.device) -> StepLauncher | None:
    """The launcher async scheduling asks for, or None for the plain loop (on a CPU by default:
    there it does not pay, README "async scheduling")."""
    cuda = device.type == "cuda"
    on = cuda if config.async_scheduling is None else config.async_scheduling
    if not on:
        return None
    mode = config.async_launch if config.async_launch != "auto" else ("inline" if cuda else "thread")
    return StepLauncher(runner, sampler, device, mode)
