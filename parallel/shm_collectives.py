"""All-reduce, all-gather and broadcast over shared memory, for the ranks of one CPU machine.

Gloo's collectives go through worker threads and TCP on every call, and a step makes two per layer:
on a CPU that cost more than the forward (docs/cpu.md). Here each rank has a slot in a shared file
(two, alternating by call, so a fast rank never overwrites what a slow one still reads) and a
sequence counter on a cache line of its own; a call writes the rank's part, publishes its counter,
spins until every counter has caught up, and reads. Every rank sums the slots in rank order, so all
get the same bits. A tensor larger than a slot goes to gloo instead.

x86 only: its stores become visible in program order, so a published counter means its data is
there (the lock round trip before publishing also drains any write-combining stores).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from mm_engine.parallel.group import ParallelError

SLOT_BYTES = 4 * 1024**2
_LINE = 64  # bytes: one counter per cache line


def supported() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


class ShmCollectives:
    def __init__(
        self, path: str, rank: int, world: int, create: bool, alive: Callable[[], bool], timeout_s: float
    ) -> None:
        self.rank, self.world, self.alive, self.timeout_s = rank, world, alive, timeout_s
        header = world * _LINE
        size = header + 2 * world * SLOT_BYTES
        if create:
            with open(path, "wb") as f:
                f.truncate(size)
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._counters = np.ndarray((world, _LINE // 8), dtype=np.int64, buffer=self._mm)[:, 0]
        self._slots = [
            [torch.frombuffer(self._mm, dtype=torch.uint8, count=SLOT_BYTES,
                              offset=header + (p * world + r) * SLOT_BYTES) for r in range(world)]
            for p in range(2)
        ]  # fmt: skip
        self._fence = threading.Lock()
        self._seq = 0

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= SLOT_BYTES

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(x)
        x.copy_(parts[0])
        for part in parts[1:]:
            x.add_(part)
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [p.clone() for p in self._exchange(x)]

    def broadcast(self, x: torch.Tensor, src: int = 0) -> None:
        """`x` from `src` into every rank's `x` (same shape and dtype everywhere)."""
        seq = self._begin()
        slot = self._view(seq, src, x)
        if self.rank == src:
            slot.copy_(x)
            self._publish(seq)
        else:
            self._wait(seq, [src])
            x.copy_(slot)
            self._publish(seq)

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        seq = self._begin()
        self._view(seq, self.rank, x).copy_(x)
        self._publish(seq)
        self._wait(seq, range(self.world))
        return [self._view(seq, r, x) for r in range(self.world)]

    def _begin(self) -> int:
        """The next call's number, once every rank is done with the call before (whose readers
        may still be in the slots this call is about to write)."""
        self._seq += 1
        self._wait(self._seq - 1, range(self.world))
        return self._seq

    def _view(self, seq: int, rank: int, like: torch.Tensor) -> torch.Tensor:
        raw = self._slots[seq & 1][rank][: like.numel() * like.element_size()]
        return raw.view(like.dtype).view(like.shape)

    def _publish(self, seq: int) -> None:
        with self._fence:
            pass
        self._counters[self.rank] = seq

    def _wait(self, seq: int, ranks) -> None:
        counters = self._counters
        idx = list(ranks)
        spins, started = 0, None
        while counters[idx].min() < seq:
            spins += 1
            if spins % 1024 == 0:
                now = time.monotonic()
                started = started or now
                if not self.alive():
                    raise ParallelError("a tensor-parallel peer is gone")
                if now - started > self.timeout_s:
                    raise ParallelError(f"a tensor-parallel collective waited over {self.timeout_s:.0f} s")
                os.sched_yield()

    def close(self) -> None:
        self._slots = []
        with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with the process
            self._mm.close()
