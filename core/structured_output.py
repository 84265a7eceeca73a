"""Structured output with xgrammar: a request's grammar (JSON schema, any JSON object, regex,
choice, EBNF) masks the logits of every token it samples.

    Grammars.submit(spec) -> compiled (cached by spec, LRU; on a thread of its own)
    GrammarState: fill(bitmask row) before a sample, accept(token) after it

Compilation is the costly part (it walks the vocabulary) and runs off the engine's step: the core
holds a request back until its grammar is ready. The mask of a step's row needs every earlier
token accepted, so with async scheduling such a step first reads the step in flight (as the
penalties do). A spec that xgrammar cannot compile is a ValueError naming it.

A JSON schema's grammar also forbids every token holding a control byte (below 0x20): xgrammar's
length-bounded strings (`minLength`, `maxLength`) let raw ones in, which no JSON parser takes, and
with compact separators no control byte is legal anywhere in the output.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch

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

    def __init__(self, tokenizer_loader, vocab_size: int, capacity: int = 256) -> None:
        """`tokenizer_loader`: returns the model's tokenizer (called once, on first use)."""
        self._load_tokenizer = tokenizer_loader
        self.vocab_size = vocab_size
        self.capacity = capacity
        self._compiler = None
        self._no_control: torch.Tensor | None = None  # bitmask row of the tokens without control bytes
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mm-grammar")

    def _get_compiler(self):
        if self._compiler is None:
            xgr = _xgr()
            info = xgr.TokenizerInfo.from_huggingface(self._load_tokenizer(), vocab_size=self.vocab_size)
            self._no_control = _packed_row([not any(b < 0x20 for b in t) for t in info.decoded_vocab])
            self._compiler = xgr.GrammarCompiler(info, max_threads=_COMPILE_THREADS)
        return self._compiler

    def submit(self, spec: StructuredOutputs) -> Future:
        """The compiled grammar, as a future (done at once when cached)."""
        key = spec.key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, key)
            self._cache[key] = future
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda f: f.exception() and self._forget(key, f))
        return future

    def compile(self, spec: StructuredOutputs) -> Any:
        """The compiled grammar, waiting for it; ValueError when the spec cannot be compiled."""
        return self.submit(spec).result()

    def _forget(self, key: tuple[str, str], future: Future) -> None:
        with self._lock:  # a failed compile is not cached: the next request gets the same error anew
            if self._cache.get(key) is future:
                del self._cache[key]

    def _compile(self, key: tuple[str, str]) -> Any:
        kind, text = key
        compiler = self._get_compiler()
        try:
            if kind == "json":
                grammar = compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
                return Compiled(grammar, self._no_control)
            if kind == "json_object":
                return Compiled(compiler.compile_builtin_json_grammar())
            if kind == "regex":
                return Compiled(compiler.compile_regex(text))
            if kind == "choice":
                import json

                xgr = _xgr()
                choices = json.loads(text)
                ebnf = "root ::= " + " | ".join(_ebnf_string(c) for c in choices)
                return Compiled(compiler.compile_grammar(xgr.Grammar.from_ebnf(ebnf)))
            return Compiled(compiler.compile_grammar(text))
        except ValueError:
            raise
        except Exception as exc:  # xgrammar reports bad specs as RuntimeError and the like
            raise ValueError(f"structured_outputs.{kind} cannot be compiled: {_first_line(exc)}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _ebnf_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _first_line(exc: Exception) -> str:
    """The library's message without its log prefix (a time and a source path of its build)."""
    lines = str(exc).strip().splitlines()
    if not lines:
        return type(exc).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", lines[0])[:300]


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
