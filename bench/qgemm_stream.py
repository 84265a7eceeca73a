"""The low-bit GEMM (kernels/cpu_qgemm.c) streaming weights from memory, as a decode step does.

`bench.kernels_cpu` times one projection over and over, so its weights stay in the last-level cache
(a 2048 x 5632 int8 weight is 11 MB; a Zen 3 CCX has 32 MB) and it reads faster than memory
allows. Here each pass runs the linear layers of several decoder layers of a Qwen3.5-0.8B-shaped
MLP and attention (more bytes than any cache holds) once each, at 1 to 8 rows, and reports the
weights' bytes per second against the read bandwidth measured in the same run: how close a decode
step's linear layers come to the roofline of the smaller weights.

`--against OLD.c` builds a second library with another version of cpu_qgemm.c (say
`git show REV:kernels/cpu_qgemm.c > OLD.c`; `--against-source cpu_gemm.c` for the float32 GEMM's)
and times the two pass by pass, interleaved, so that the machine's drift (on a shared VM, the same
pass moves by 1.5x from one minute to the next) falls on both alike: before against after in one
run. Kind `fp32` is the float32 panels of cpu_gemm.c, the baseline the low-bit kinds are against.

    python -m bench.qgemm_stream --kinds fp32,int8,int4,bf16 --json bench/results/qgemm_stream.json
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bench.machine import machine_info, memory_bytes_per_s
from bench.save import save_json
from mm_engine.kernels import cpu_build
from mm_engine.models.layers.packed_linear import PanelLinear
from mm_engine.models.layers.quant_linear import QuantLinear, quantize

# (out, in) of one decoder layer's projections: the fused MLP up/gate, its down, a fused linear-
# attention input projection and its output (the benchmark model's shapes).
LAYER_SHAPES = ((7168, 1024), (1024, 3584), (8224, 1024), (1024, 2048))


def stream(
    kind: str, layers: int, rows: list[int], passes: int, libs: dict, shapes=LAYER_SHAPES, seed: int = 0
) -> list[dict]:
    """Per row count and library (`libs`: name -> kernel library): the best of `passes` passes over
    `layers` copies of `shapes`' weights, the libraries taking turns pass by pass."""
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(n, k, generator=g) * 0.02 for _ in range(layers) for n, k in shapes]
    if kind != "fp32":
        weights = [quantize(w, kind) for w in weights]
    linears: dict[str, list[torch.nn.Module]] = {name: [] for name in libs}
    for w in weights:  # packed in turns, so that neither build's panels all come first in memory
        for name, lib in libs.items():
            linears[name].append(_panel_linear(w, lib) if kind == "fp32" else QuantLinear(w, None, lib))
    first = next(iter(linears.values()))
    nbytes = sum(_weight_bytes(lin) for lin in first)
    out = []
    for m in rows:
        xs = {k: torch.randn(m, k, generator=g) for _, k in shapes}
        best = dict.fromkeys(libs, float("inf"))
        for i in range(passes):
            order = list(linears.items())
            for name, lins in order if i % 2 == 0 else order[::-1]:  # ABBA: neither always goes first
                t = time.perf_counter()
                for lin in lins:
                    lin(xs[lin.in_features])
                best[name] = min(best[name], time.perf_counter() - t)
        for name, sec in best.items():
            out.append({"build": name, "kind": kind, "rows": m, "bytes": nbytes, "ms": sec * 1e3,
                        "bytes_per_s": nbytes / sec})  # fmt: skip
    return out


def _panel_linear(w: torch.Tensor, lib: ctypes.CDLL) -> PanelLinear:
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data = w
    return PanelLinear(lin, lib)


def other_build(source: Path, replaces: str = "cpu_qgemm.c") -> ctypes.CDLL:
    """The kernel library of the best variant here, with `source` as its `replaces` source."""
    folder = Path(tempfile.mkdtemp(prefix="qgemm-against-"))
    for f in (*cpu_build.SOURCES, *cpu_build.HEADERS):  # (the sources include their header by name)
        shutil.copy(f, folder / f.name)
    shutil.copy(source, folder / replaces)
    return cpu_build.build(cpu_build.best_variant(), [folder / f.name for f in cpu_build.SOURCES])


def _weight_bytes(lin: torch.nn.Module) -> int:
    if isinstance(lin, PanelLinear):
        return _nbytes(lin.panels)
    panels = lin.a8 if lin.a8 is not None else lin.panels  # int8 inputs: cpu_qgemm_a8.c's panels
    return _nbytes(panels.weights) + _nbytes(panels.scales)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="int8,int4,bf16,fp8")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--layers", type=int, default=6, help="decoder layers' weights a pass streams")
    ap.add_argument("--passes", type=int, default=7, help="passes per cell (the best is kept)")
    ap.add_argument("--against", type=Path, default=None, help="another cpu_qgemm.c, timed interleaved")
    ap.add_argument("--against-source", default="cpu_qgemm.c", help="the source --against replaces")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.inference_mode().__enter__()
    libs = {"this": cpu_build.load()}
    if libs["this"] is None:
        raise SystemExit("the CPU kernels could not be built here")
    if args.against is not None:
        libs["against"] = other_build(args.against, args.against_source)
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for kind in args.kinds.split(","):
        results += stream(kind, args.layers, rows, args.passes, libs)
    bandwidth = memory_bytes_per_s()  # after the passes: the same minutes of the machine's drift
    info = machine_info()
    print(f"{info['cpu']}, {torch.get_num_threads()} threads, {cpu_build.best_variant()} kernels, "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s")  # fmt: skip
    head = f"{'build':8} {'kind':6} {'rows':>4} {'MB':>8} {'ms':>8} {'GB/s':>7}"
    print(f"{head} {'of bandwidth':>13} {'speedup':>8}")
    this = {(r["kind"], r["rows"]): r["ms"] for r in results if r["build"] == "this"}
    for r in results:
        r["of_bandwidth"] = r["bytes_per_s"] / bandwidth
        if r["build"] == "against":  # how much faster this build is than the other
            r["this_speedup"] = r["ms"] / this[(r["kind"], r["rows"])]
        speedup = f"{r['this_speedup']:7.2f}x" if "this_speedup" in r else ""
        print(f"{r['build']:8} {r['kind']:6} {r['rows']:4d} {r['bytes'] / 1e6:8.1f} {r['ms']:8.2f} "
              f"{r['bytes_per_s'] / 1e9:7.1f} {r['of_bandwidth']:12.0%} {speedup:>8}")  # fmt: skip
    result = {
        "machine": info,
        "variant": cpu_build.best_variant(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "bandwidth_bytes_per_s": bandwidth,
        "rows": results,
    }
    save_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
