"""The CPU kernels in C (`cpu_decode.c`, `cpu_prefill.c`, `cpu_elementwise.c`, `cpu_gemm.c`,
`cpu_kv_write.c`): built once, loaded via ctypes.

They are compiled on first use with the system C compiler (`cc`, or `$CC`) for this CPU into one
library, cached under `~/.cache/mm-engine/kernels` (or `$MM_ENGINE_CACHE`), keyed by the sources,
the flags and the CPU's feature flags. Without a compiler, or when the build fails, `load()`
returns None once with a warning and callers keep the torch path: the kernels are an
acceleration, never a requirement.
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

SOURCES = [
    Path(__file__).with_name(name)
    for name in ("cpu_decode.c", "cpu_prefill.c", "cpu_elementwise.c", "cpu_gemm.c", "cpu_kv_write.c")
]
# -ffast-math compiles only: linked with it, the library would bring crtfastmath's start-up code,
# which turns on flush-to-zero for the whole process (Python floats included).
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
LINK = ["-shared", "-fopenmp"]
_UNSET = object()
_lib: object = _UNSET

_P, _I32, _I64, _F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
SIGNATURES = {
    "paged_decode": [_P, _P, _P, _P, _I64, _P, _P, _I32, _I32, _I32, _I32, _I32, _F32, _I32, _I32],
    "paged_prefill": [
        *(_P, _I64, _I64, _P, _P, _I64, _I64, _I64),  # q and its strides, k, v and their strides
        *(_P, _I64, _P, _P, _P, _I32, _P),  # tables, starts, query and sequence lengths, n, out
        *(_I32, _I32, _I32, _I32, _F32, _I32, _I32),  # heads, kv heads, block, dim, scale, causal
    ],
    "silu_and_mul": [_P, _I64, _P, _I64, _I64, _I32],
    "gelu_tanh_": [_P, _I64, _I32],
    "rms_norm": [_P, _P, _P, _P, _P, _I64, _I64, _F32, _I32],
    "rotary_": [_P, _I64, _I32, _I64, _I32, _P, _P, _I32],
    "gemm_panels": [_P, _I64, _P, _P, _P, _I64, _I32, _I32, _I32, _I32],
    "write_kv": [
        *(_P, _I64, _I64, _P, _I64, _I64),  # key and value with their token and head strides
        *(_P, _P, _I64, _I64, _I64),  # k and v cache, their block, slot and head strides
        *(_P, _I32, _I32, _I32, _I32, _I32),  # slots, tokens, kv heads, dim, block size, threads
    ],
}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build(compiler: str) -> Path:
    sources = b"".join(s.read_bytes() for s in SOURCES)
    setup = " ".join([compiler, *FLAGS, *LINK, _cpu_flags()]).encode()
    key = hashlib.sha256(sources + setup).hexdigest()[:16]
    root = Path(os.environ.get("MM_ENGINE_CACHE", Path.home() / ".cache" / "mm-engine")) / "kernels"
    target = root / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: build into the temp folder instead
        root = Path(tempfile.gettempdir()) / "mm-engine-kernels"
        root.mkdir(parents=True, exist_ok=True)
        target = root / target.name
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        objects = [Path(tmp) / f"{s.stem}.o" for s in SOURCES]
        for source, obj in zip(SOURCES, objects, strict=True):
            _run([compiler, *FLAGS, "-c", str(source), "-o", str(obj)])
        built = Path(tmp) / target.name
        _run([compiler, *LINK, *map(str, objects), "-o", str(built), "-lm"])
        os.replace(built, target)  # atomic: concurrent builders each land a whole file
    return target


def _run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)


def lib_for(*tensors) -> ctypes.CDLL | None:
    """The library, when it is built and every tensor is a float32 CPU tensor (what the kernels
    take); else None, and the caller keeps its torch path."""
    if all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors):
        return load()
    return None


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
            for name, argtypes in SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
            _lib = lib
        except (OSError, subprocess.SubprocessError) as e:
            detail = (getattr(e, "stderr", b"") or b"").decode(errors="replace")[-500:]
            log.warning("CPU C kernels unavailable, using the torch path: %s %s", e, detail)
    return _lib  # type: ignore[return-value]
