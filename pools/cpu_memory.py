"""CPU memory settings for an engine process: glibc malloc thresholds, and huge pages for the KV pool.

A forward pass on CPU allocates and frees tensors of a few MB all the time. glibc serves those
with fresh mmap()s and hands them back with munmap(), so every one costs a page fault per 4 KiB
page on first touch; in a VM that dominated small ops. Keeping freed memory in the heap (rather
than returning it to the OS at once) is what the allocators PyTorch recommends for CPU inference
(jemalloc, tcmalloc) do too; the price is that RSS stays near its peak.

The KV pool is read in 4 KiB runs scattered over GiBs: with 4 KiB pages nearly every run is a TLB
miss. `huge_page_empty` allocates it with transparent huge pages (2 MiB) asked for by madvise,
which Linux grants in its default "madvise" mode. The first write to each huge page costs more (2
MiB zeroed, and compaction where memory is fragmented), so it is opt-in (`cpu_huge_pages`), for
servers whose pool stays warm. docs/cpu.md has the figures for both.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math

import torch

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024**2  # glibc's maximum: blocks below this come from the heap
TRIM_THRESHOLD = 1024**3  # free heap kept before glibc returns memory to the OS
_done = False


def tune_malloc() -> bool:
    """Apply the settings once per process (glibc only; elsewhere a no-op). True when applied."""
    global _done
    if _done:
        return True
    mallopt = _libc_fn("mallopt")
    if mallopt is None:
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.warning("mallopt refused the CPU memory settings; running with glibc's defaults")
    _done = ok
    return ok


_MADV_HUGEPAGE = 14
HUGE_PAGE = 2 * 1024**2


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`torch.empty(shape, dtype)` on CPU, 2 MiB-aligned and advised to use transparent huge pages
    before its first touch. Where madvise is unavailable or refused it is plain memory all the
    same; pages still cost resident memory only once written (2 MiB at a time)."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # slack to align the start
    skip = -raw.data_ptr() % HUGE_PAGE
    madvise = _libc_fn("madvise") if nbytes >= HUGE_PAGE else None
    start, length = ctypes.c_void_p(raw.data_ptr() + skip), ctypes.c_size_t(nbytes)
    if madvise is not None and madvise(start, length, _MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) refused; the KV pool keeps normal pages")
    return raw[skip : skip + nbytes].view(dtype).view(shape)


@functools.cache
def _libc_fn(name: str):
    """A libc function, looked up once (find_library runs ldconfig); None where there is none."""
    lib = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(lib), name, None) if lib else None
    except OSError:
        return None
