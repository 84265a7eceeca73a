"""The CPU kernels in C, built once per ISA variant and loaded via ctypes.

Variants (cpu_simd.h sizes the vectors and register tiles from each):
- `avx512`: AVX-512 F/BW/DQ/VL with AVX2 and FMA, 64-byte vectors;
- `avx2`: AVX2 and FMA, 32-byte vectors;
- `portable`: the architecture's baseline (SSE2 on x86-64, NEON on aarch64), compiler-vectorised.

Which variants this CPU runs is read from cpuid (`cpu_features.c`, built without ISA flags), never
from a text file, and a variant is loaded only where the CPU has every feature it was compiled
for: whatever the build cache holds, no illegal instruction can be reached. Each library is
compiled with IEEE semantics (no -ffast-math) and explicit ISA flags (no -march=native), cached
under `~/.cache/mm-engine/kernels` (or `$MM_ENGINE_CACHE`) keyed by the sources, the compiler,
the flags and the OpenMP runtime it links.

One thread pool: the libraries link the OpenMP runtime torch itself loaded (found in the
process's memory map), so their parallel regions run on torch's intra-op threads and
`torch.set_num_threads` governs both. Without a compiler, or when a build fails, `load()` returns
None and says why in `status()`; callers keep the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch  # loaded first: its OpenMP runtime is the one the kernels link

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = [
    HERE / f"{n}.c"
    for n in (
        "cpu_decode",
        "cpu_prefill",
        "cpu_elementwise",
        "cpu_gemm",
        "cpu_kv_write",
        "cpu_linear_attention",
        "cpu_qgemm",
        "cpu_qgemm_a8",
        "cpu_layer_decode",
    )
]
HEADERS = [HERE / "cpu_simd.h"]
FEATURES = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512bf16")
# IEEE semantics kept: no -ffinite-math-only, no reciprocal approximations. errno and traps are
# never read, and dropping them lets sqrtf and the comparisons vectorise.
COMMON = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-fopenmp"]


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    flags: tuple[str, ...]
    needs: tuple[str, ...]  # cpuid features, all required


_AVX2 = ("-mavx", "-mavx2", "-mfma")
_AVX512 = (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl")
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
_BASE = ("-march=x86-64",) if _X86 else ("-march=armv8-a",) if platform.machine() == "aarch64" else ()
VARIANTS = {
    "avx512": Variant("avx512", (*_BASE, *_AVX512, "-DMM_VEC_BYTES=64"), FEATURES[:7]),
    "avx2": Variant("avx2", (*_BASE, *_AVX2, "-DMM_VEC_BYTES=32"), ("avx", "avx2", "fma")),
    "portable": Variant("portable", (*_BASE, "-DMM_VEC_BYTES=16"), ()),
}
if not _X86:  # the x86 variants cannot even be compiled there
    VARIANTS = {"portable": VARIANTS["portable"]}

_P, _I32, _I64, _F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
SIGNATURES = {
    "paged_decode": [_P, _P, _P, _P, _I64, _P, _P, _I32, _I32, _I32, _I32, _I32, _F32, _I32, _I32],
    "paged_prefill": [
        *(_P, _I64, _I64, _P, _P, _I64, _I64, _I64),  # q and its strides, k, v and their strides
        *(_P, _I64, _P, _P, _P, _I32, _P),  # tables, starts, query and sequence lengths, n, out
        *(_I32, _I32, _I32, _I32, _F32, _I32),  # heads, kv heads, block, dim, scale, causal
        *(_P, _I32, _I32),  # per-token bidirectional ends (or NULL), window (0: none), threads
    ],
    "silu_and_mul": [_P, _I64, _P, _I64, _I64, _I32],
    "delta_rule_step_": [_P, _P, _P, _I64, _P, _P, _P, _I64, _I32, _I32, _I32, _I32, _I32],
    "gelu_tanh_": [_P, _I64, _I32],
    "rms_norm": [_P, _P, _P, _P, _P, _I64, _I64, _F32, _I32],
    "gated_rms_norm": [_P, _P, _P, _P, _I64, _I64, _F32, _I32],
    "conv_step_": [_P, _P, _P, _I64, _P, _P, _I64, _I32, _I32, _I32],
    "gated_delta_decode_": [
        *(_P, _P, _P, _P, _I64, _P, _I64, _P, _P, _I64),  # conv, state, slots, mixed, z, b, a and strides
        *(_P, _P, _P, _P, _F32, _P),  # conv weight, A_log, dt_bias, norm weight, eps, out
        *(_I64, _I32, _I32, _I32, _I32, _I32, _I32),  # batch, heads, key heads, dk, dv, width, threads
    ],
    "rotary_": [_P, _I64, _I32, _I64, _I32, _P, _P, _I32],
    "mlp_decode": [_P, _P, _P, _P, _P, _I32, _I32, _I32],  # layer, residual, mixed, scratch, out, hidden, M
    # layer, x, residual, conv, state, slots, scratch, out, M, threads
    "delta_layer_decode": [_P, _P, _P, _P, _P, _P, _P, _P, _I32, _I32],
    # layer, x, residual, cos, sin, kv rows, scratch, out, M, threads
    "attn_layer_decode": [_P, _P, _P, _P, _P, _P, _P, _P, _I32, _I32],
    "gemm_panels": [_P, _I64, _P, _P, _P, _I64, _I32, _I32, _I32, _I32],
    "gemm_panel_width": [],
    "qgemm_panels": [_P, _I64, _P, _I32, _P, _P, _I32, _P, _P, _I64, _I32, _I32, _I32, _I32],
    "qgemm_a8_kinds": [],
    "qgemm_a8_panels": [_P, _I64, _P, _P, _I32, _P, _P, _P, _I32, _P, _P, _I64, _I32, _I32, _I32, _I32],
    "write_kv": [
        *(_P, _I64, _I64, _P, _I64, _I64),  # key and value with their token and head strides
        *(_P, _P, _I64, _I64, _I64),  # k and v cache, their block, slot and head strides
        *(_P, _I32, _I32, _I32, _I32, _I32),  # slots, tokens, kv heads, dim, block size, threads
    ],
}

_libs: dict[str, ctypes.CDLL | None] = {}
_errors: dict[str, str] = {}
_features: frozenset[str] | None = None


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def compiler_version() -> str | None:
    cc = compiler()
    return None if cc is None else _version(cc)


@functools.cache
def _version(cc: str) -> str | None:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out else None


def openmp_runtime() -> Path | None:
    """The OpenMP runtime this process has loaded (torch's own), from its memory map."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    for line in maps:
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        name = os.path.basename(path)
        if name.startswith(("libgomp", "libiomp5", "libomp")) and ".so" in name:
            return Path(path)
    return None


def cpu_features() -> frozenset[str]:
    """This CPU's features (of FEATURES), from cpuid; empty where the probe cannot be built."""
    global _features
    if _features is None:
        _features = frozenset()
        try:
            probe = _load_library("probe", [HERE / "cpu_features.c"], [], link_openmp=False)
            bits = probe.cpu_features()
            _features = frozenset(f for i, f in enumerate(FEATURES) if bits >> i & 1)
        except (OSError, subprocess.SubprocessError, FileNotFoundError) as e:
            _errors["probe"] = _describe(e)
    return _features


def supported(name: str) -> bool:
    """Whether this CPU runs variant `name` (known, and every feature it needs is present)."""
    variant = VARIANTS.get(name)
    return variant is not None and set(variant.needs) <= cpu_features()


def best_variant(wanted: str | None = None) -> str:
    """`wanted` (default `$MM_ENGINE_CPU_VARIANT`) where it is given and this CPU runs it, else
    the widest variant this CPU runs."""
    wanted = wanted or os.environ.get("MM_ENGINE_CPU_VARIANT")
    if wanted:
        if wanted not in VARIANTS:
            raise ValueError(f"cpu_kernel_variant must be one of {sorted(VARIANTS)}, got {wanted!r}")
        if not supported(wanted):
            raise ValueError(f"cpu_kernel_variant {wanted}: this CPU lacks {why_unsupported(wanted)}")
        return wanted
    return next(name for name in VARIANTS if supported(name))


def why_unsupported(name: str) -> str:
    missing = [f for f in VARIANTS[name].needs if f not in cpu_features()] if name in VARIANTS else [name]
    return ", ".join(missing)


def load(variant: str | None = None) -> ctypes.CDLL | None:
    """The kernel library of `variant` (default: `best_variant()`), built on first call; None when
    it cannot be built here or the CPU cannot run it (`status()` says why)."""
    name = variant or best_variant()
    if name not in _libs:
        _libs[name] = None
        if not supported(name):
            _errors[name] = f"this CPU lacks {why_unsupported(name)}"
        else:
            try:
                _libs[name] = build(name, SOURCES)
            except (OSError, subprocess.SubprocessError, FileNotFoundError) as e:
                _errors[name] = _describe(e)
                log.warning("CPU C kernels (%s) unavailable, using the torch path: %s", name, _errors[name])
    return _libs[name]


def build(variant: str, sources: list[Path]) -> ctypes.CDLL:
    """`sources` built as variant `variant`'s library, its functions typed. `load` builds the
    package's own; a bench may build another version of a source beside it."""
    lib = _load_library(variant, sources, list(VARIANTS[variant].flags))
    for fn_name, argtypes in SIGNATURES.items():
        fn = getattr(lib, fn_name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return lib


def takes(*tensors: torch.Tensor) -> bool:
    """Whether every tensor is what the kernels take: float32 on the CPU."""
    return all(t.is_cpu and t.dtype == torch.float32 for t in tensors)  # per layer: no device objects


def status() -> dict:
    """What was found and built: for `mm-engine env`, /health and the start-up log."""
    return {
        "machine": platform.machine(),
        "features": sorted(cpu_features()),
        "compiler": compiler_version(),
        "openmp_runtime": str(openmp_runtime() or ""),
        "built": sorted(n for n, lib in _libs.items() if lib is not None),
        "errors": dict(_errors),
    }


def _describe(e: Exception) -> str:
    detail = (getattr(e, "stderr", b"") or b"").decode(errors="replace").strip()[-400:]
    return f"{e} {detail}".strip()


def _load_library(name: str, sources: list[Path], flags: list[str], link_openmp: bool = True) -> ctypes.CDLL:
    cc = compiler()
    if cc is None or shutil.which(cc) is None:
        raise FileNotFoundError(f"no C compiler ({'$CC=' + cc if cc else 'cc, gcc or $CC'} not found)")
    runtime = openmp_runtime() if link_openmp else None
    # torch's runtime by path (its soname is already loaded, so the library shares it); where none
    # is mapped, the compiler's own.
    link = [str(runtime), f"-Wl,-rpath,{runtime.parent}"] if runtime else ["-fopenmp"] if link_openmp else []
    try:
        return ctypes.CDLL(str(_build(cc, name, sources, flags, link)))
    except (OSError, subprocess.SubprocessError):
        if not runtime:
            raise
        log.warning("linking torch's OpenMP runtime failed; the %s kernels use the compiler's", name)
        return ctypes.CDLL(str(_build(cc, name, sources, flags, ["-fopenmp"])))


def _build(cc: str, name: str, sources: list[Path], flags: list[str], link: list[str]) -> Path:
    text = b"".join(p.read_bytes() for p in [*sources, *HEADERS])
    setup = " ".join([cc, compiler_version() or "", *COMMON, *flags, *link]).encode()
    key = hashlib.sha256(text + setup).hexdigest()[:16]
    root = Path(os.environ.get("MM_ENGINE_CACHE", Path.home() / ".cache" / "mm-engine")) / "kernels"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: build into the temp folder instead
        root = Path(tempfile.gettempdir()) / "mm-engine-kernels"
        root.mkdir(parents=True, exist_ok=True)
    target = root / f"cpu_kernels-{name}-{key}.so"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        objects = [Path(tmp) / f"{s.stem}.o" for s in sources]
        compiles = [
            [cc, *COMMON, *flags, f"-I{HERE}", "-c", str(s), "-o", str(o)]
            for s, o in zip(sources, objects, strict=True)
        ]
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # the sources compile side by side
            list(pool.map(_run, compiles))
        built = Path(tmp) / target.name
        _run([cc, "-shared", *map(str, objects), *link, "-o", str(built), "-lm"])
        os.replace(built, target)  # atomic: concurrent builders each land a whole file
    return target


def _run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=180)
