"""Structured output with xgrammar: a request's grammar (JSON schema, any JSON object, regex,
choice, EBNF) masks the logits of every token it samples.

    Grammars.submit(spec) -> compiled (cached by spec, LRU, bounded by bytes; on a thread of its own)
    GrammarState: fill(bitmask row) before a sample, accept(token) after it

Compilation is the costly part (it walks the vocabulary) and runs off the engine's step: the core
holds a request back until its grammar is ready. A spec over the limits (core/grammar_limits.py) is
refused before it is compiled, and a compiled grammar that no token of the vocabulary can begin
(it accepts nothing, or nothing this vocabulary spells) is refused rather than run to max_tokens.
The mask of a step's row needs every earlier token accepted, so with async scheduling such a step
first reads the step in flight (as the penalties do). A spec that xgrammar cannot compile is a
ValueError naming it.

A JSON schema's grammar also forbids every token holding a control byte (below 0x20): xgrammar's
length-bounded strings (`minLength`, `maxLength`) let raw ones in, which no JSON parser takes, and
with compact separators no control byte is legal anywhere in the output.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch

from mm_engine.config import EngineConfig
from mm_engine.core.grammar_compile import compile_spec
from mm_engine.core.grammar_limits import GrammarLimits
from mm_engine.core.grammar_probe import GrammarProbe
from mm_engine.sampling_params import StructuredOutputs

_COMPILE_THREADS = 2


def _xgr():
    import xgrammar  # imported on first use: a server that never sees a grammar never loads it

    return xgrammar


@dataclass(frozen=True, slots=True)
class Compiled:
    grammar: Any  # xgrammar's CompiledGrammar
    allowed: torch.Tensor | None = None  # a bitmask row ANDed into every mask (None: no extra rule)


class Grammars:
    """Compiled grammars of one vocabulary, by spec."""

    def __init__(
        self,
        tokenizer_loader,
        vocab_size: int,
        capacity: int = 256,
        *,
        limits: GrammarLimits | None = None,
        capacity_bytes: int = 512 * 1024**2,
        timeout_s: float = 5.0,
        trial_memory_bytes: int | None = None,
    ) -> None:
        """`tokenizer_loader`: returns the model's tokenizer (called once, on first use).
        `capacity`, `capacity_bytes`: the cache's bounds (compiled grammars, their memory);
        `timeout_s`: how long `compile` waits for one; `trial_memory_bytes`: set, each new spec is
        first compiled in a process that is stopped past `timeout_s` or this many bytes
        (core/grammar_probe.py), and only then here."""
        self._load_tokenizer = tokenizer_loader
        self.vocab_size = vocab_size
        self.capacity = capacity
        self.capacity_bytes = capacity_bytes
        self.limits = limits or GrammarLimits()
        self.timeout_s = timeout_s
        self._sizes: dict[tuple[str, str], int] = {}  # compiled grammars' bytes, by spec
        self._waiting: dict[tuple[str, str], int] = {}  # callers waiting on a compile, by spec
        self.cached_bytes = 0
        self._compiler = None
        self._no_control: torch.Tensor | None = None  # bitmask row of the tokens without control bytes
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mm-grammar")
        self.trial_memory_bytes = trial_memory_bytes
        self._probe: GrammarProbe | None = None
        self._trying: tuple[str, str] | None = None  # the spec whose trial compile runs now

    @classmethod
    def for_config(cls, config: EngineConfig, tokenizer_loader, vocab_size: int) -> Grammars:
        """The grammars of an engine: its limits, cache and timeout from `config`."""
        limits = GrammarLimits(config.max_grammar_bytes, config.max_grammar_entries, config.max_grammar_depth)
        return cls(
            tokenizer_loader, vocab_size, limits=limits, capacity_bytes=config.grammar_cache_bytes,
            timeout_s=config.grammar_compile_timeout_s,
            trial_memory_bytes=config.grammar_compile_memory_bytes,
        )  # fmt: skip

    def _get_compiler(self):
        if self._compiler is None:
            xgr = _xgr()
            info = xgr.TokenizerInfo.from_huggingface(self._load_tokenizer(), vocab_size=self.vocab_size)
            self._no_control = _packed_row([not any(b < 0x20 for b in t) for t in info.decoded_vocab])
            self._compiler = xgr.GrammarCompiler(info, max_threads=_COMPILE_THREADS)
            if self.trial_memory_bytes:
                self._probe = GrammarProbe(info.serialize_json(), self.timeout_s, self.trial_memory_bytes)
        return self._compiler

    def submit(self, spec: StructuredOutputs) -> Future:
        """The compiled grammar, as a future (done at once when cached). A spec over the limits
        is a ValueError here, before anything compiles it."""
        key = spec.key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
        self.limits.check(*key)
        with self._lock:
            future = self._cache.get(key)
            created = future is None
            if created:
                future = self._pool.submit(self._compile_and_keep, key)
                self._cache[key] = future
                self._evict()
        if created:  # outside the lock: a done future calls back at once, and the callback takes it
            future.add_done_callback(lambda f: self._settle(key, f))
        return future

    def compile(self, spec: StructuredOutputs) -> Any:
        """The compiled grammar, waiting for it (at most `timeout_s`); ValueError when the spec
        cannot be compiled in time."""
        future = self.submit(spec)
        with self._waiter(spec.key(), future):
            try:
                return future.result(self._wait_s())
            except TimeoutError:
                raise ValueError(self.timeout_message(spec)) from None

    async def ready(self, spec: StructuredOutputs) -> Any:
        """The same from an event loop, which it never blocks: a waiter that leaves (its client
        went away: this is cancelled) stops waiting."""
        future = self.submit(spec)
        with self._waiter(spec.key(), future):
            try:
                return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self._wait_s())
            except TimeoutError:
                raise ValueError(self.timeout_message(spec)) from None

    @contextlib.contextmanager
    def _waiter(self, key: tuple[str, str], future: Future) -> Iterator[None]:
        """Count who waits on a compile; when the last one leaves (timed out, or its client went
        away) before the compile has started, it is dropped, and during its trial, the trial is
        stopped: a burst of abandoned specs does not keep the compile thread busy after their 400s."""
        with self._lock:
            self._waiting[key] = self._waiting.get(key, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._waiting.pop(key) - 1
                ours = not left and self._cache.get(key) is future
                drop = ours and not (future.done() or future.running())
                stop = ours and self._trying == key
                if left:
                    self._waiting[key] = left
                elif drop:
                    del self._cache[key]
            if drop:
                future.cancel()  # outside the lock: its done-callbacks take it; a started one runs on
            elif stop and self._probe is not None:
                self._probe.stop(key[1])  # its trial compile: the future fails, and is not cached

    def _wait_s(self) -> float:
        """How long a waiter waits: the timeout, and the trial process's start while it has none."""
        return self.timeout_s + (GrammarProbe.start_allowance() if self.trial_memory_bytes else 0.0)

    def timeout_message(self, spec: StructuredOutputs) -> str:
        kind = spec.key()[0]
        return f"structured_outputs.{kind} took longer than {self.timeout_s:g} s to compile; simplify it"

    def _compile_and_keep(self, key: tuple[str, str]) -> Compiled:
        """Compile, and count the grammar's bytes in the cache before anyone gets it."""
        compiled = self._compile(key)
        with self._lock:
            if key in self._cache and key not in self._sizes:
                self._sizes[key] = compiled.grammar.memory_size_bytes
                self.cached_bytes += self._sizes[key]
                self._evict()
        return compiled

    def _settle(self, key: tuple[str, str], future: Future) -> None:
        with self._lock:  # a failed compile is not cached: the next request gets the same error anew
            if self._cache.get(key) is future and future.exception() is not None:
                del self._cache[key]

    def _evict(self) -> None:
        """Least recently used first, down to both bounds (call under the lock)."""
        while len(self._cache) > self.capacity or (
            self.cached_bytes > self.capacity_bytes and len(self._cache) > 1
        ):
            key, _ = self._cache.popitem(last=False)
            self.cached_bytes -= self._sizes.pop(key, 0)

    def _compile(self, key: tuple[str, str]) -> Compiled:
        kind, text = key
        compiler = self._get_compiler()
        if self._probe is not None:  # a trial run that can be stopped first (core/grammar_probe.py)
            with self._lock:
                self._trying = key
            try:
                self._probe.check(kind, text)
            finally:
                with self._lock:
                    self._trying = None
        grammar = compile_spec(compiler, kind, text)
        compiled = Compiled(grammar, self._no_control if kind in ("json", "json_object") else None)
        if not _can_start(compiled, self.vocab_size):
            raise ValueError(
                f"structured_outputs.{kind} accepts no output that this model's vocabulary can begin"
            )
        return compiled

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _can_start(compiled: Compiled, vocab_size: int) -> bool:
    """Whether some token may come first (an empty language, or one whose first characters no
    token spells, leaves none: the request would only emit padding until max_tokens)."""
    bitmask = allocate_bitmask(1, vocab_size)
    GrammarState(compiled).fill(bitmask, 0)
    return bool(bitmask.any())


def _packed_row(ok: list[bool]) -> torch.Tensor:
    """Booleans per token as one row of xgrammar's bitmask (int32 words, token i at bit i % 32)."""
    bits = torch.tensor(ok + [False] * (-len(ok) % 32), dtype=torch.int64).view(-1, 32)
    words = (bits << torch.arange(32)).sum(1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


class GrammarState:
    """One request's place in its grammar."""

    def __init__(self, compiled: Compiled) -> None:
        self._matcher = _xgr().GrammarMatcher(compiled.grammar)
        self._allowed = compiled.allowed

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of an xgrammar bitmask."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self._allowed is not None:
            n = min(bitmask.shape[1], self._allowed.numel())
            bitmask[row, :n] &= self._allowed[:n]

    def accept(self, token: int) -> bool:
        return self._matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        return self._matcher.is_terminated()


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    return _xgr().allocate_token_bitmask(rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Mask `logits` [rows, vocab] in place: -inf where the bitmask's row forbids a token."""
    _xgr().apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True))


class GrammarWaitlist:
    """Structured requests whose grammar is still compiling: the core queues them once it is."""

    def __init__(self, grammars: Grammars) -> None:
        self.grammars = grammars
        self._items: list[tuple[Any, Future]] = []

    def add(self, req: Any) -> None:
        self._items.append((req, self.grammars.submit(req.params.structured_outputs)))

    def remove(self, req: Any) -> None:
        self._items = [(r, f) for r, f in self._items if r is not req]

    def __len__(self) -> int:
        return len(self._items)

    def wait(self, timeout: float) -> None:
        """Until one compile is done, or `timeout` s."""
        wait([f for _, f in self._items], timeout=timeout, return_when=FIRST_COMPLETED)

    def take_ready(self) -> tuple[list[Any], list[tuple[Any, Exception]]]:
        """The requests whose grammar is ready (their `grammar` set), and those whose failed."""
        ready, failed, left = [], [], []
        for req, future in self._items:
            if not future.done():
                left.append((req, future))
            elif future.exception() is not None:
                failed.append((req, future.exception()))
            else:
                req.grammar = GrammarState(future.result())
                ready.append(req)
        self._items = left
        return ready, failed


def fill_allowed(reqs: list[Any], rows: list[Any], vocab_size: int) -> None:
    """Give each row whose request has a grammar the bitmask of the tokens allowed next."""
    constrained = [i for i, r in enumerate(reqs) if r.grammar is not None]
    if not constrained:
        return
    bitmask = allocate_bitmask(len(constrained), vocab_size)
    for j, i in enumerate(constrained):
        reqs[i].grammar.fill(bitmask, j)
        rows[i].allowed = bitmask[j]
