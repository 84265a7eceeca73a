"""A grammar's trial compile in a process of its own, stopped at a deadline or a memory cap.

xgrammar cannot stop a compile once it has begun, and a spec within every limit of
core/grammar_limits.py may still take minutes or gigabytes (a regex's nested repeats, a schema's
optional properties). So a new spec is first compiled here, in a child process: past
`deadline_s`, or grown past `memory_bytes`, the child is killed and the spec refused (a
ValueError naming it); a waiter that leaves (its client went away) stops it too. Only a spec that
passed is compiled again by the engine, on its own compile thread, in a time and a memory the
trial has shown. The second compile is the price; grammars are cached, and most compile in
milliseconds.

One child serves every probe of a process (the frontend's and an in-process core's grammars):
started on first use, kept, and started afresh after a kill. It speaks pickles on its stdin and
stdout: ("info", key, tokenizer info JSON) once per vocabulary, then ("compile", key, kind, text).
"""

from __future__ import annotations

import os
import pickle
import resource
import select
import subprocess
import sys
import threading
from typing import Any

_START_TIMEOUT_S = 120.0  # importing xgrammar (and torch) in a new process, on a busy machine


class GrammarProbe:
    """Trial compiles for one vocabulary (`tokenizer_info`: xgrammar's TokenizerInfo as JSON)."""

    def __init__(self, tokenizer_info: str, deadline_s: float, memory_bytes: int) -> None:
        self.info = tokenizer_info
        self.key = str(hash(tokenizer_info))
        self.deadline_s = deadline_s
        self.memory_bytes = memory_bytes

    def check(self, kind: str, text: str) -> None:
        """Return once the spec compiles within the deadline and the memory cap; else ValueError."""
        _CHILD.trial(self, kind, text)

    def stop(self, text: str) -> None:
        """Stop the trial of `text` under way, or about to start, if it is this probe's (its
        caller gets a ValueError)."""
        _CHILD.stop(self, text)

    @staticmethod
    def start_allowance() -> float:
        """Seconds a waiter adds to its timeout while the trial process is not running yet (its
        start is no compile's fault)."""
        return 0.0 if _CHILD.running() else _START_TIMEOUT_S


class _Child:
    """The one trial process of this process, and the lock that takes turns on it."""

    def __init__(self) -> None:
        self._turn = threading.Lock()  # one trial at a time
        self._guard = threading.Lock()  # the fields below
        self._proc: subprocess.Popen | None = None
        self._cap = 0  # the running child's memory cap
        self._known: set[str] = set()  # vocabularies the child has a compiler for
        self._owner: GrammarProbe | None = None  # whose trial runs now
        self._stopped = False
        self._pending: tuple[GrammarProbe, str] | None = None  # a stop before its trial began

    def trial(self, probe: GrammarProbe, kind: str, text: str) -> None:
        with self._turn:
            with self._guard:  # a stop that came while the child was still starting
                early = self._pending == (probe, text)
                self._pending = None
            if early:
                raise ValueError(f"structured_outputs.{kind}: compile stopped, its every client left")
            proc = self._started(probe.memory_bytes)
            if probe.key not in self._known:
                _send(proc, ("info", probe.key, probe.info))
                self._known.add(probe.key)
            with self._guard:
                self._owner, self._stopped = probe, self._pending == (probe, text)
                self._pending = None
            try:
                if self._stopped:  # stopped while its child started: no compile at all
                    raise ValueError(f"structured_outputs.{kind}: compile stopped, its every client left")
                _send(proc, ("compile", probe.key, kind, text))
                reply = _receive(proc, probe.deadline_s)
            finally:
                with self._guard:
                    self._owner = None
                    stopped = self._stopped
            if reply is _TIMEOUT:
                self._kill()
                took = f"took longer than {probe.deadline_s:g} s to compile"
                raise ValueError(f"structured_outputs.{kind} {took}; simplify it")
            if reply is None:  # the child died: killed by stop(), or by the memory cap
                self._kill()
                if stopped:
                    raise ValueError(f"structured_outputs.{kind}: compile stopped, its every client left")
                raise ValueError(self._memory_message(kind, probe))
            status, message = reply
            if status == "memory":
                raise ValueError(self._memory_message(kind, probe))
            if status == "error":
                raise ValueError(message)

    def running(self) -> bool:
        with self._guard:
            return self._proc is not None and self._proc.poll() is None

    def stop(self, probe: GrammarProbe, text: str) -> None:
        with self._guard:
            if self._owner is not probe:
                self._pending = (probe, text)  # its trial has not reached the child yet
                return
            self._stopped = True
            proc = self._proc
        if proc is not None:
            proc.kill()  # the trial's read sees the end of the pipe

    @staticmethod
    def _memory_message(kind: str, probe: GrammarProbe) -> str:
        cap = probe.memory_bytes / 1024**2
        return f"structured_outputs.{kind} needs more than {cap:.0f} MiB to compile; simplify it"

    def _started(self, memory_bytes: int) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            if self._cap == memory_bytes:
                return self._proc
            self._kill()  # another engine's cap (tests build several in one process)
        cmd = [sys.executable, "-m", "mm_engine.core.grammar_probe", str(memory_bytes)]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        if _receive(proc, _START_TIMEOUT_S) != ("ready", ""):
            proc.kill()
            proc.wait()
            raise ValueError("structured output is unavailable: the grammar compile process did not start")
        with self._guard:
            self._proc, self._known, self._cap = proc, set(), memory_bytes
        return proc

    def _kill(self) -> None:
        with self._guard:
            proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()


_CHILD = _Child()
_TIMEOUT = object()


def _send(proc: subprocess.Popen, message: tuple) -> None:
    try:
        pickle.dump(message, proc.stdin)
        proc.stdin.flush()
    except (BrokenPipeError, OSError):
        pass  # the child is gone: the read that follows finds the end of the pipe


def _receive(proc: subprocess.Popen, timeout_s: float) -> Any:
    """The child's next reply; `_TIMEOUT` when none came in time; None when the child is gone."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    if not ready:
        return _TIMEOUT
    try:
        return pickle.load(proc.stdout)
    except (EOFError, pickle.UnpicklingError, OSError):
        return None


def _serve(memory_bytes: int) -> None:
    """The child: compilers by vocabulary, one spec at a time, every reply a pickle on stdout."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout = sys.stderr  # a library's print must not break the replies
    import xgrammar

    from mm_engine.core.grammar_compile import compile_spec

    # The cap counts from here: what importing took is not the grammar's.
    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (used + memory_bytes, used + memory_bytes))
    compilers: dict[str, Any] = {}
    pickle.dump(("ready", ""), out)
    out.flush()
    while True:
        try:
            message = pickle.load(sys.stdin.buffer)
        except EOFError:
            return
        if message[0] == "info":
            _, key, info = message
            tokenizer = xgrammar.TokenizerInfo.deserialize_json(info)
            # No cache: every trial is a real compile (the engine caches what passed).
            compilers[key] = xgrammar.GrammarCompiler(tokenizer, max_threads=1, cache_enabled=False)
            continue
        _, key, kind, text = message
        try:
            compile_spec(compilers[key], kind, text)
            reply = ("ok", "")
        except MemoryError:
            reply = ("memory", "")
        except ValueError as exc:
            reply = ("error", str(exc))
        pickle.dump(reply, out)
        out.flush()


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
