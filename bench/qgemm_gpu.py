"""Low-bit GEMMs on a CUDA GPU against the float16 product: `python -m bench.qgemm_gpu [--json PATH]`.

For the projections of a 7B-class language model (Qwen2.5-VL-7B's widths) at 1 to 1024 rows:
float16 `F.linear` (cuBLAS), the Triton kernel on each stored kind (W4A16, W8A16, FP8 and bf16
weights with float16 inputs, kernels/triton_qgemm.py), dequantize-then-matmul for int4 (what a
layer without a kernel does), FP8 on both sides through `torch._scaled_mm` (kernels/fp8_mm.py,
one scale per weight row, the input rounded per token), and, where this PyTorch has it, FP8 with
128x128 weight blocks through `F.scaled_mm`'s block-wise recipes (an experiment: the engine does
not use it yet). Each time is the median of CUDA-event timings (`triton.testing.do_bench`) while
cycling through enough copies of the weights that none is read from L2. Each row also gives the
relative error against the float32 product of the same stored weights (input unrounded).
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F
import triton.testing

from bench.machine import machine_info
from bench.save import save_json
from mm_engine.kernels import fp8_mm, triton_qgemm
from mm_engine.kernels.cpu_qgemm import int4_bytes
from mm_engine.models.layers.quant_linear import quantize

SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
ROWS = (1, 16, 128, 1024)
L2_BYTES = 256 * 1024**2  # cycle through at least this many bytes of weights per contender


def _copies(nbytes: int) -> int:
    return max(1, min(8, -(-L2_BYTES // nbytes)))


def _cycle(items: list):
    it = itertools.cycle(items)
    return lambda: next(it)


def _contenders(n: int, k: int, x: torch.Tensor) -> dict:
    """name -> (a function of no arguments computing x W^T, the float32 weight it multiplies by)."""
    g = torch.Generator(device="cpu").manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) / k**0.5).cuda()
    out: dict = {}
    dense = [w.half() for _ in range(_copies(w.numel() * 2))]
    pick = _cycle(dense)
    out["fp16"] = (lambda: F.linear(x, pick()), w)
    for kind in ("int4", "int8", "fp8", "bf16"):
        q = quantize(w, kind)
        stored = int4_bytes(q.q) if kind == "int4" else q.q
        weights = [(stored.clone(), q.scales) for _ in range(_copies(stored.numel() * stored.element_size()))]
        pick_q = _cycle(weights)

        def run(kind=kind, pick_q=pick_q, q=q):
            s, scales = pick_q()
            return triton_qgemm.qgemm(x, kind, s, scales, None, q.group, None)

        out[f"triton_{kind}"] = (run, q.dequantize())
        if kind == "int4":
            out["dequantize_int4"] = (lambda q=q: F.linear(x, q.dequantize().half()), q.dequantize())
    if fp8_mm.device_supports(x.device):
        rowwise = quantize(w, "fp8", group=k)
        copies = [rowwise.q.clone() for _ in range(_copies(rowwise.q.numel()))]
        pick_8 = _cycle(copies)
        out["scaled_mm_fp8_rowwise"] = (
            lambda: fp8_mm.fp8_linear(x, pick_8(), rowwise.scales, None, None),
            rowwise.dequantize(),
        )
        block = _blockwise(w, x)
        if block is not None:
            out["scaled_mm_fp8_block128"] = block
    return out


def _blockwise(w: torch.Tensor, x: torch.Tensor):
    """FP8 with 128x128 weight blocks and 1x128 input groups through F.scaled_mm, if this PyTorch
    and GPU take it (None otherwise); the layout of the scales is the one its recipes ask for."""
    recipes = getattr(F, "ScalingType", None)
    if recipes is None or not hasattr(F, "scaled_mm"):
        return None
    n, k = w.shape
    wb = w.view(n // 128, 128, k // 128, 128)
    w_scale = wb.abs().amax((1, 3)).float() / 448.0  # [N/128, K/128]
    wq = (wb / w_scale[:, None, :, None]).view(n, k).to(torch.float8_e4m3fn)
    deq = (wq.float().view(n // 128, 128, k // 128, 128) * w_scale[:, None, :, None]).view(n, k)

    def run():
        xg = x.float().view(x.shape[0], k // 128, 128)
        x_scale = (xg.abs().amax(-1) / 448.0).clamp(min=1e-12)  # [M, K/128]
        xq = (xg / x_scale[..., None]).view(x.shape[0], k).to(torch.float8_e4m3fn)
        return F.scaled_mm(
            xq, wq.t(), x_scale.t().contiguous().t(), recipes.BlockWise1x128,
            w_scale, recipes.BlockWise128x128, output_dtype=torch.bfloat16,
        )  # fmt: skip

    try:
        run()
    except Exception as error:  # noqa: BLE001 - an experiment: record why and move on
        print(f"  block-wise F.scaled_mm not run: {str(error).splitlines()[0][:160]}", file=sys.stderr)
        return None
    return run, deq


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.qgemm_gpu needs a CUDA GPU")
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    for (name, (n, k)), m in itertools.product(SHAPES.items(), rows_list):
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        contenders = _contenders(n, k, x)
        base = None
        for label, (fn, weight) in contenders.items():
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            want = F.linear(x.float(), weight.float())
            err = ((fn().float() - want).norm() / want.norm()).item()
            base = ms if label == "fp16" else base
            results.append(
                dict(shape=name, n=n, k=k, rows=m, contender=label, ms=ms, vs_fp16=base / ms,
                     tflops=2 * m * n * k / ms / 1e9, rel_error=err)
            )  # fmt: skip
        del contenders
        torch.cuda.empty_cache()
    print(f"{'shape':8} {'rows':>5} {'contender':24} {'ms':>8} {'vs fp16':>8} {'TFLOP/s':>8} {'rel err':>8}")
    for r in results:
        print(
            f"{r['shape']:8} {r['rows']:>5} {r['contender']:24} {r['ms']:8.4f} {r['vs_fp16']:8.2f} "
            f"{r['tflops']:8.1f} {r['rel_error']:8.1e}"
        )
    save_json(args.json, dict(machine=machine_info(), device=torch.cuda.get_device_name(), results=results))


if __name__ == "__main__":
    main()
