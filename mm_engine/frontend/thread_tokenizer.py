"""A tokenizer that every thread uses its own copy of.

A fast (Rust) tokenizer must not be entered by two threads at once: an encode that sets its
truncation or padding borrows it mutably, and a decode or encode on another thread then fails
with "Already borrowed". The input workers tokenize while the engine thread detokenizes, so each
thread gets a private deep copy, made the first time that thread asks (a copy of a large
vocabulary takes some milliseconds, once per thread).
"""

from __future__ import annotations

import copy
import threading
from typing import Any


class PerThreadTokenizer:
    """Forwards every call and attribute to the calling thread's copy of `base`; `base` itself is
    never used through this object, so its owner (the detokenizer) may keep it to itself."""

    def __init__(self, base: Any) -> None:
        self._base = base
        self._local = threading.local()
        self._copy_lock = threading.Lock()  # deepcopy reads `base`: not while another copies it

    def get(self) -> Any:
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            with self._copy_lock:
                tok = self._local.tokenizer = copy.deepcopy(self._base)
        return tok

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.get()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.get(), name)
