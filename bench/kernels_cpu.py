"""Each CPU C kernel against its torch/oneDNN twin, per ISA variant, at decode and prefill shapes
of the benchmark model (bench.vlm: 576-wide decoder, 9/3 heads of 64, a 768-wide SigLIP tower).

    python -m bench.kernels_cpu [--variants avx512,avx2,portable] [--out bench/results/kernels_cpu.json]

Every variant runs in its own process with torch held to the same ISA (`ATEN_CPU_CAPABILITY`,
`ONEDNN_MAX_CPU_ISA`, `MKL_ENABLE_INSTRUCTIONS`), so the avx2 row of an AVX-512 machine pits AVX2
code against AVX2 code. Within a process the two sides of a row alternate, best of several
rounds. The table says, per variant, which kernels won everywhere they ran and whether
kernels/cpu_kernels.py's MEASURED_FASTER agrees.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.machine import machine_info
from bench.save import save_json

# torch held to each variant's ISA (read by torch, oneDNN and MKL at start-up).
TORCH_ISA = {
    "avx512": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "portable": {
        "ATEN_CPU_CAPABILITY": "default",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    },
}
# A kernel is used where it beats its twin over its shapes (geometric mean) and loses at none by
# more than the noise between two runs of one row (a few percent on this machine).
MIN_GEOMEAN, MIN_SPEEDUP = 1.0, 0.95


def best_ms(fn: Callable[[], object], budget_s: float, rounds: int) -> float:
    """Best over `rounds` of the mean time per call, each round about budget_s / rounds long."""
    fn()
    start, n = time.perf_counter(), 0
    while n < 3 or time.perf_counter() - start < budget_s / rounds / 4:
        fn()
        n += 1
    per = (time.perf_counter() - start) / n
    calls = max(1, int(budget_s / rounds / max(per, 1e-7)))
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e3)
    return min(times)


def cases(quick: bool) -> list[tuple[str, str, Callable, Callable]]:
    """(kernel, shape, C side, torch side): closures over prepared inputs of one variant."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.kernels_cpu_cases import attention_cases, layer_decode_cases
    from mm_engine.kernels import cpu_elementwise
    from mm_engine.kernels.cpu_kernels import KERNELS, select
    from mm_engine.kernels.ops import TORCH_OPS
    from mm_engine.models.layers.packed_linear import PackedLinear, PanelLinear

    kernels = select(kernels="all")
    assert kernels is not None and kernels.enabled == frozenset(KERNELS)
    lib = kernels.lib
    g = torch.Generator().manual_seed(0)
    hidden, inter, vision_mlp, vocab = (64, 128, 128, 512) if quick else (576, 1536, 3072, 49152)
    out: list[tuple[str, str, Callable, Callable]] = []

    # The decoder layer's four linears (q/k/v, o, gate/up, down), and the LM head.
    layer = [nn.Linear(hidden, hidden + 128 * 3), nn.Linear(hidden, hidden), nn.Linear(hidden, 2 * inter),
             nn.Linear(inter, hidden)]  # fmt: skip
    head = nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        for lin in (*layer, head):
            lin.weight.normal_(0, 0.02, generator=g)
    fast, onednn = [PanelLinear(m, lib) for m in layer], [PackedLinear(m) for m in layer]
    fast_head, onednn_head = PanelLinear(head, lib), PackedLinear(head)
    for rows in (1, 16, 64) if quick else (1, 16, 64, 512):
        xs = {k: torch.randn(rows, k, generator=g) for k in (hidden, inter)}

        out.append((
            "gemm", f"decoder layer, {rows} rows",
            lambda xs=xs: [m(xs[m.in_features]) for m in fast],
            lambda xs=xs: [m(xs[m.in_features]) for m in onednn],
        ))  # fmt: skip
    h = torch.randn(64, hidden, generator=g)
    out.append(("gemm", "LM head, 64 rows", lambda: fast_head(h), lambda: onednn_head(h)))

    out += attention_cases(kernels, quick, g)

    for rows in (64, 2048) if not quick else (64, 256):
        x, d = torch.randn(rows, hidden, generator=g), torch.randn(rows, hidden, generator=g) * 1e-3
        w = torch.rand(hidden, generator=g) + 0.5
        out.append((
            "rms_norm", f"add + norm, {rows} x {hidden}",
            lambda x=x, d=d, w=w: cpu_elementwise.rms_norm(lib, x, w, 1e-6, d),
            lambda x=x, d=d, w=w: F.rms_norm(x.add_(d), (hidden,), w, 1e-6),
        ))  # fmt: skip
        qkv = torch.randn(rows, 15 * 64, generator=g)  # 9 query, 3 key and 3 value heads
        qk = qkv[:, : 12 * 64].view(rows, 12, 64)
        cos, sin = torch.randn(rows, 1, 32, generator=g), torch.randn(rows, 1, 32, generator=g)
        out.append((
            "rotary", f"{rows} tokens x 12 heads x 64",
            lambda qk=qk, c=cos, s=sin: cpu_elementwise.rotary_(lib, qk, c, s),
            lambda qk=qk, c=cos, s=sin: TORCH_OPS.rotary(qk, c, s),
        ))  # fmt: skip
        gu = torch.randn(rows, 2 * inter, generator=g)
        out.append((
            "silu_and_mul", f"{rows} x {inter}",
            lambda gu=gu: cpu_elementwise.silu_and_mul(lib, gu),
            lambda gu=gu: TORCH_OPS.silu_and_mul(gu),
        ))  # fmt: skip
    # Gated DeltaNet's decode step at Qwen3.5-0.8B's heads (16 key and value heads of 128): C in
    # place in the pool against the torch path's gather, five passes and scatter.
    from mm_engine.kernels import cpu_linear_attention

    heads, dk = (4, 32) if quick else (16, 128)
    for batch in (1, 8) if quick else (1, 8, 32):
        pool = torch.randn(batch + 2, heads, dk, dk, generator=g) * 0.1
        slots = torch.arange(batch) + 1
        qkv = torch.randn(batch, 3 * heads * dk, generator=g)
        decay, beta = -torch.rand(batch, heads, generator=g), torch.rand(batch, heads, generator=g)
        args = (pool, slots, qkv, decay, beta, heads)
        out.append((
            "delta_rule", f"{batch} seqs x {heads} heads x {dk}x{dk}",
            lambda a=args: cpu_linear_attention.delta_rule_step_(lib, *a),
            lambda a=args: TORCH_OPS.delta_rule_step_(*a),
        ))  # fmt: skip
        # The conv in front of it (q, k and v channels, width 4; the inputs a view into the wider
        # projection) and the gated norm after it: counted under `delta_rule` and `rms_norm`.
        channels = 3 * heads * dk
        conv, conv_w = torch.randn(batch + 2, channels, 3, generator=g), torch.randn(channels, 4, generator=g)
        mixed = torch.randn(batch, channels + 2 * heads, generator=g)[:, :channels]
        conv_args = (conv, slots, mixed, conv_w)
        out.append((
            "delta_rule", f"conv step, {batch} seqs x {channels} channels",
            lambda a=conv_args: cpu_linear_attention.conv_step_(lib, *a),
            lambda a=conv_args: TORCH_OPS.conv_step_(*a),
        ))  # fmt: skip
        # The whole decode after the input projection in one call (conv, gates, delta rule, gated
        # norm) against TorchOps' composition of the same steps in torch.
        from mm_engine.kernels.gated_delta import DeltaWeights

        proj = torch.randn(batch, channels + heads * dk + 2 * heads, generator=g)
        parts = proj.split([channels, heads * dk, heads, heads], -1)
        dw = DeltaWeights(conv_w, torch.rand(heads, generator=g), torch.rand(heads, generator=g),
                          torch.rand(dk, generator=g), 1e-6, heads)  # fmt: skip
        fused_args = (conv, pool, slots, *parts, dw)
        out.append((
            "delta_rule", f"whole decode, {batch} seqs x {heads} heads",
            lambda a=fused_args: cpu_linear_attention.gated_delta_decode_(lib, *a),
            lambda a=fused_args: TORCH_OPS.gated_delta_decode_(*a),
        ))  # fmt: skip
        y, z = torch.randn(batch * heads, dk, generator=g), torch.randn(batch * heads, dk, generator=g)
        nw = torch.rand(dk, generator=g)
        out.append((
            "rms_norm", f"gated, {batch * heads} x {dk}",
            lambda y=y, z=z, w=nw: cpu_elementwise.gated_rms_norm(lib, y, z, w, 1e-6),
            lambda y=y, z=z, w=nw: TORCH_OPS.gated_rms_norm(y, z, w, 1e-6),
        ))  # fmt: skip
    # Quantized linears (an MLP projection of a 2048-wide model, 128-column groups): the low-bit
    # GEMM against dequantize-then-matmul, at decode and prefill row counts.
    from mm_engine.models.layers.quant_linear import QuantLinear, quantize

    n, k = (256, 256) if quick else (5632, 2048)
    weight = torch.randn(n, k, generator=g) * 0.02
    for kind in ("int8", "int4", "w8a8", "w4a8"):  # w*a8: int8 inputs, the integer kernel where it runs
        low_bit = QuantLinear(quantize(weight, kind), None, lib)
        dequantizing = QuantLinear(quantize(weight, kind), None)
        for rows in (1, 8) if quick else (1, 8, 256):
            x = torch.randn(rows, k, generator=g)
            out.append((
                "qgemm", f"{kind}, {rows} x {k} -> {n}",
                lambda f=low_bit, x=x: f(x),
                lambda f=dequantizing, x=x: f(x),
            ))  # fmt: skip
    out += layer_decode_cases(kernels, quick, g)
    act = torch.randn(2 if quick else 8 * 196, vision_mlp, generator=g)
    out.append((
        "gelu_tanh", f"{act.shape[0]} x {vision_mlp} (vision MLP)",
        lambda: cpu_elementwise.gelu_tanh_(lib, act.normal_()),
        lambda: F.gelu(act.normal_(), approximate="tanh"),
    ))  # fmt: skip
    return out


def run_variant(quick: bool, budget_s: float, rounds: int) -> dict:
    import torch

    from mm_engine.kernels import cpu_build

    rows = []
    torch.inference_mode().__enter__()  # the engine runs inference-mode forwards too
    for kernel, shape, c_fn, torch_fn in cases(quick):
        c_ms, t_ms = [], []
        for _ in range(2):  # alternate the two sides: drift on the machine hits both
            c_ms.append(best_ms(c_fn, budget_s / 2, rounds))
            t_ms.append(best_ms(torch_fn, budget_s / 2, rounds))
        c, t = min(c_ms), min(t_ms)
        rows.append({"kernel": kernel, "shape": shape, "c_ms": c, "torch_ms": t, "speedup": t / c})
    return {
        "variant": cpu_build.best_variant(),
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "rows": rows,
    }


def verdict(rows: list[dict]) -> dict[str, dict]:
    by: dict[str, list[float]] = {}
    for r in rows:
        by.setdefault(r["kernel"], []).append(r["speedup"])
    out = {}
    for k, v in by.items():
        geomean = math.exp(sum(map(math.log, v)) / len(v))
        out[k] = {
            "min_speedup": min(v),
            "geomean": geomean,
            "faster": geomean > MIN_GEOMEAN and min(v) >= MIN_SPEEDUP,
        }
    return out


def print_table(results: dict) -> None:
    from mm_engine.kernels.cpu_kernels import MEASURED_FASTER

    print(f"CPU: {results['cpu']}  (torch {results['torch']}, {results['threads']} threads)")
    for name, res in results["variants"].items():
        print(f"\n{name} (torch held to {res['torch_capability']})")
        print(f"  {'kernel':<17} {'shape':<34} {'C ms':>9} {'torch ms':>9} {'speedup':>8}")
        for r in res["rows"]:
            ms = f"{r['c_ms']:>9.3f} {r['torch_ms']:>9.3f}"
            print(f"  {r['kernel']:<17} {r['shape']:<34} {ms} {r['speedup']:>7.2f}x")
        table = MEASURED_FASTER.get(name, frozenset())
        for k, v in res["verdict"].items():
            agrees = "agrees" if (k in table) == v["faster"] else "DISAGREES"
            use = "use" if v["faster"] else "torch"
            print(f"  -> {k:<17} min {v['min_speedup']:.2f}x, geomean {v['geomean']:.2f}x: {use} ({agrees})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=None, help="comma-separated (default: all this CPU runs)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/kernels_cpu.json"))
    parser.add_argument("--budget", type=float, default=0.6, help="seconds per side per row")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run, not figures)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        json.dump(run_variant(args.quick, args.budget, args.rounds), sys.stdout)
        return 0
    import torch

    from mm_engine.kernels import cpu_build
    from mm_engine.models.platform import environment

    names = (
        args.variants.split(",")
        if args.variants
        else [v for v in cpu_build.VARIANTS if cpu_build.supported(v)]
    )
    env = environment()
    results = {"cpu": env["cpu"], "cpu_features": env["cpu_features"], "torch": torch.__version__,
               "threads": torch.get_num_threads(), "machine": machine_info(), "variants": {}}  # fmt: skip
    for name in names:
        child_env = {**os.environ, **TORCH_ISA.get(name, {}), "MM_ENGINE_CPU_VARIANT": name}
        cmd = [sys.executable, "-m", "bench.kernels_cpu", "--child", "--budget", str(args.budget),
               "--rounds", str(args.rounds), *(["--quick"] if args.quick else [])]  # fmt: skip
        with tempfile.TemporaryFile("w+") as out:
            subprocess.run(cmd, env=child_env, stdout=out, check=True)
            out.seek(0)
            res = json.load(out)
        res["verdict"] = verdict(res["rows"])
        results["variants"][name] = res
    print_table(results)
    save_json(args.out, results)
    print(f"\nsaved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
