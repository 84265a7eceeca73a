"""The C decode-attention kernel for the CPU pool (`cpu_decode.c`): built once, called via ctypes.

The kernel reads each sequence's K/V straight from the pool, where the torch path first gathers a
padded copy; on the benchmark model that is 2-5x faster per layer. It is compiled on first use with
the system C compiler (`cc`, or `$CC`) for this CPU and cached under `~/.cache/mm-engine/kernels`
(or `$MM_ENGINE_CACHE`), keyed by the source, the flags and the CPU's feature flags. Without a
compiler, or when the build fails, `load()` returns None once with a warning and the caller keeps
the torch path: the kernel is an acceleration, never a requirement.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.c")
# -ffast-math compiles only: linked with it, the library would bring crtfastmath's start-up code,
# which turns on flush-to-zero for the whole process (Python floats included).
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
LINK = ["-shared", "-fopenmp"]
_UNSET = object()
_lib: object = _UNSET


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build(compiler: str) -> Path:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *FLAGS, *LINK, _cpu_flags()]).encode()).hexdigest()[:16]
    root = Path(os.environ.get("MM_ENGINE_CACHE", Path.home() / ".cache" / "mm-engine")) / "kernels"
    target = root / f"cpu_decode-{key}.so"
    if target.exists():
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: build into the temp folder instead
        root = Path(tempfile.gettempdir()) / "mm-engine-kernels"
        root.mkdir(parents=True, exist_ok=True)
        target = root / target.name
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        obj, built = Path(tmp) / "cpu_decode.o", Path(tmp) / target.name
        for cmd in (
            [compiler, *FLAGS, "-c", str(SOURCE), "-o", str(obj)],
            [compiler, *LINK, str(obj), "-o", str(built), "-lm"],
        ):
            subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        os.replace(built, target)  # atomic: concurrent builders each land a whole file
    return target


def load() -> ctypes.CDLL | None:
    """The kernel library, built on first call; None when it cannot be built here."""
    global _lib
    if _lib is _UNSET:
        _lib = None
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        try:
            if compiler is None:
                raise FileNotFoundError("no C compiler (cc, gcc or $CC) on PATH")
            lib = ctypes.CDLL(str(_build(compiler)))
            p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
            lib.paged_decode.argtypes = [p, p, p, p, i64, p, p, i32, i32, i32, i32, i32, f32, i32, i32]
            lib.paged_decode.restype = i32
            _lib = lib
        except (OSError, subprocess.SubprocessError) as e:
            detail = (getattr(e, "stderr", b"") or b"").decode(errors="replace")[-500:]
            log.warning("CPU decode kernel unavailable, using the torch path: %s %s", e, detail)
    return _lib  # type: ignore[return-value]


def paged_decode(
    q: torch.Tensor,  # [n, heads, dim]
    k_cache: torch.Tensor,  # the pool's [blocks, slots, kv_heads, dim] view of head-major storage
    v_cache: torch.Tensor,
    tables: torch.Tensor,  # [n, width] int32
    lens: torch.Tensor,  # [n] int32
    max_len: int,
    scale: float,
) -> torch.Tensor | None:
    """Attention of one query per sequence, or None when the kernel does not apply here (not
    built, not float32, not the pool's layout); the caller then takes the torch path."""
    lib = load()
    by_head = (k_cache.transpose(1, 2), v_cache.transpose(1, 2))
    if lib is None or q.dtype != torch.float32 or k_cache.dtype != torch.float32:
        return None
    if not (by_head[0].is_contiguous() and by_head[1].is_contiguous()):
        return None
    n, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    q = q.contiguous()
    tables = tables.to(torch.int32).contiguous()
    lens = lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    status = lib.paged_decode(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        tables.stride(0),
        lens.data_ptr(),
        out.data_ptr(),
        n,
        heads,
        kv_heads,
        block_size,
        dim,
        scale,
        max_len,
        torch.get_num_threads(),
    )
    return out if status == 0 else None
