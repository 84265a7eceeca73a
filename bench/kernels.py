"""Triton paged attention against torch SDPA on the same K/V: `python -m bench.kernels [--out PATH]`.

Decode: achieved bandwidth (bytes of K/V and Q read / time) as a fraction of the device's measured
copy bandwidth. Prefill: TFLOP/s of causal attention (counted as causal for every variant), and
Gemma 3's two masks beside it: `triton_window` (a sliding window of WINDOW tokens) and
`triton_images` (every IMAGE_EVERY positions an image of IMAGE_TOKENS tokens whose queries see the
whole image, as `AttentionMetadata.bidirectional` hands them), each against SDPA with the same
mask as a dense boolean `attn_mask` (`sdpa_window`, `sdpa_images`). The baseline is
`scaled_dot_product_attention` on the same K/V gathered into contiguous tensors, so the ratio
shows what paging costs (or saves).
The paged caches are laid out as the engine allocates them (`pools.kv_cache.paged_kv_tensor`:
head-major within each block); `triton_slot_major` runs the same kernel on a slot-major copy
(`[block, slot, kv_head, dim]` contiguous), the layout the engine used before, to show what the
layout does on a GPU.
Times are medians of CUDA-event spans after warmup. The L2 flush queued before each call also gives
the CPU time to launch ahead, so they are GPU times with little of the Python launch overhead.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.save import save_json
from mm_engine.kernels.metadata import AttentionMetadata
from mm_engine.kernels.triton_backend import TritonBackend
from mm_engine.pools.kv_cache import paged_kv_tensor

DECODE_BATCHES = (1, 4, 16, 64, 256)
PREFILL_BATCHES = (1, 4, 16)
CONTEXTS = (512, 2048, 8192)
MAX_PREFILL_TOKENS = 65536  # skip prefill points above this many tokens per batch
WINDOW = 1024  # Gemma 3's local layers
IMAGE_TOKENS, IMAGE_EVERY = 256, 1024  # Gemma 3's image: 256 soft tokens


@dataclass(slots=True)
class Shape:
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.float16


@dataclass(slots=True)
class Case:
    query: torch.Tensor  # [tokens, heads, dim], for the paged kernel
    k_cache: torch.Tensor  # the engine's layout: head-major within a block, slot-major view
    v_cache: torch.Tensor
    k_slot_major: torch.Tensor  # the same values, [block, slot, kv_head, dim] contiguous
    v_slot_major: torch.Tensor
    meta: AttentionMetadata
    q_dense: torch.Tensor  # [batch, heads, query_len, dim], for SDPA
    k_dense: torch.Tensor  # [batch, kv_heads, seq_len, dim]
    v_dense: torch.Tensor


def make_case(batch: int, query_len: int, seq_len: int, shape: Shape, device: torch.device) -> Case:
    """`batch` sequences of `seq_len` tokens, the last `query_len` of them new, in scattered blocks."""
    bs = shape.block_size
    blocks_per_seq = -(-seq_len // bs)
    num_blocks = batch * blocks_per_seq
    # A random permutation scatters each sequence over the cache, as a long-running pool would.
    tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, blocks_per_seq)
    k_cache = paged_kv_tensor(num_blocks, bs, shape.num_kv_heads, shape.head_dim, shape.dtype, device)
    v_cache = paged_kv_tensor(num_blocks, bs, shape.num_kv_heads, shape.head_dim, shape.dtype, device)
    k_cache.normal_()
    v_cache.normal_()
    q_shape = (batch * query_len, shape.num_heads, shape.head_dim)
    query = torch.randn(q_shape, device=device, dtype=shape.dtype)

    def dense(cache: torch.Tensor) -> torch.Tensor:
        flat = cache[tables.long()].reshape(batch, blocks_per_seq * bs, shape.num_kv_heads, shape.head_dim)
        return flat[:, :seq_len].transpose(1, 2).contiguous()

    meta = AttentionMetadata(
        query_start_loc=torch.arange(0, batch * query_len + 1, query_len, device=device, dtype=torch.int32),
        seq_lens=torch.full((batch,), seq_len, device=device, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.zeros(batch * query_len, device=device, dtype=torch.int64),  # unused here
        max_query_len=query_len,
        max_seq_len=seq_len,
        query_lens_cpu=[query_len] * batch,
        seq_lens_cpu=[seq_len] * batch,
    )
    q_dense = query.view(batch, query_len, shape.num_heads, shape.head_dim).transpose(1, 2).contiguous()
    return Case(
        query, k_cache, v_cache, k_cache.contiguous(), v_cache.contiguous(), meta, q_dense,
        dense(k_cache), dense(v_cache),
    )  # fmt: skip


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int = 5, iters: int = 20) -> float:
    """Median milliseconds per call: CUDA events on a GPU, wall clock elsewhere (interpreter checks).

    On a GPU the L2 cache is flushed before each call (outside the timed span), so small decode cases
    read their K/V from DRAM like large ones instead of reporting L2 bandwidth.
    """
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends, strict=True):
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth, counting the bytes read and the bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, iters=iters)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def sdpa(case: Case, causal: bool) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        case.q_dense, case.k_dense, case.v_dense, is_causal=causal, enable_gqa=True
    )


def bench_decode(batch: int, seq_len: int, shape: Shape, device: torch.device, copy_gbs: float) -> dict:
    case = make_case(batch, 1, seq_len, shape, device)
    scale = shape.head_dim**-0.5
    auto, single = TritonBackend(), TritonBackend(num_splits=1)
    splits = auto.splits_for(case.meta, shape.num_kv_heads, device)
    elt = case.k_cache.element_size()
    bytes_read = 2 * batch * seq_len * shape.num_kv_heads * shape.head_dim * elt + case.query.nbytes
    row = {"batch": batch, "context": seq_len, "num_splits": splits}
    runs = {
        "triton": lambda: auto.attend(case.query, case.k_cache, case.v_cache, case.meta, scale),
        "triton_nosplit": lambda: single.attend(case.query, case.k_cache, case.v_cache, case.meta, scale),
        "triton_slot_major": lambda: auto.attend(
            case.query, case.k_slot_major, case.v_slot_major, case.meta, scale
        ),
        "sdpa": lambda: sdpa(case, causal=False),
    }
    for name, fn in runs.items():
        ms = time_ms(fn, device)
        row[f"{name}_ms"] = ms
        row[f"{name}_bw_frac"] = bytes_read / (ms * 1e-3) / 1e9 / copy_gbs
    row["speedup_vs_sdpa"] = row["sdpa_ms"] / row["triton_ms"]
    return row


def gemma_masks(case: Case, seq_len: int, device: torch.device) -> tuple[tuple, torch.Tensor, torch.Tensor]:
    """(bidirectional ranges for the paged kernel, the dense image mask, the dense window mask)."""
    pos = torch.arange(seq_len, device=device)
    in_image = (pos % IMAGE_EVERY) < IMAGE_TOKENS
    lo = torch.where(in_image, pos - pos % IMAGE_EVERY, 0)
    hi = torch.where(in_image, lo + IMAGE_TOKENS, 0).clamp(max=seq_len)
    batch = case.q_dense.shape[0]
    ranges = (lo.repeat(batch), hi.repeat(batch))
    causal = pos[None, :] <= pos[:, None]
    images = causal | ((pos[None, :] >= lo[:, None]) & (pos[None, :] < hi[:, None]))
    window = causal & (pos[None, :] > pos[:, None] - WINDOW)
    return ranges, images, window


def bench_prefill(batch: int, seq_len: int, shape: Shape, device: torch.device) -> dict:
    case = make_case(batch, seq_len, seq_len, shape, device)
    scale = shape.head_dim**-0.5
    backend = TritonBackend()
    ranges, image_mask, window_mask = gemma_masks(case, seq_len, device)
    with_images = AttentionMetadata(
        **{**{f: getattr(case.meta, f) for f in case.meta.__slots__}, "bidirectional": ranges}
    )
    # Causal: query i meets i + 1 keys; two matmuls of 2 * dim FLOPs per (query, key, head).
    flops = 4 * batch * shape.num_heads * shape.head_dim * seq_len * (seq_len + 1) / 2
    row = {"batch": batch, "context": seq_len}
    runs = {
        "triton": lambda: backend.attend(case.query, case.k_cache, case.v_cache, case.meta, scale),
        "triton_slot_major": lambda: backend.attend(
            case.query, case.k_slot_major, case.v_slot_major, case.meta, scale
        ),
        "sdpa": lambda: sdpa(case, causal=True),
        "triton_window": lambda: backend.attend(
            case.query, case.k_cache, case.v_cache, case.meta, scale, window=WINDOW
        ),
        "sdpa_window": lambda: F.scaled_dot_product_attention(
            case.q_dense, case.k_dense, case.v_dense, attn_mask=window_mask, enable_gqa=True
        ),
        "triton_images": lambda: backend.attend(case.query, case.k_cache, case.v_cache, with_images, scale),
        "sdpa_images": lambda: F.scaled_dot_product_attention(
            case.q_dense, case.k_dense, case.v_dense, attn_mask=image_mask, enable_gqa=True
        ),
    }
    for name, fn in runs.items():
        ms = time_ms(fn, device)
        row[f"{name}_ms"] = ms
        row[f"{name}_tflops"] = flops / (ms * 1e-3) / 1e12
    row["speedup_vs_sdpa"] = row["sdpa_ms"] / row["triton_ms"]
    return row


def run(device: torch.device, shape: Shape, decode_grid, prefill_grid, copy_bytes: int = 1 << 30) -> dict:
    copy_gbs = copy_bandwidth_gbs(device, copy_bytes)
    results: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "shape": {**asdict(shape), "dtype": str(shape.dtype)},
        "copy_bandwidth_gbs": copy_gbs,
        "decode": [],
        "prefill": [],
    }
    for kind, grid in (("decode", decode_grid), ("prefill", prefill_grid)):
        for batch, seq_len in grid:
            try:
                if kind == "decode":
                    row = bench_decode(batch, seq_len, shape, device, copy_gbs)
                else:
                    row = bench_prefill(batch, seq_len, shape, device)
            except torch.cuda.OutOfMemoryError:
                row = {"batch": batch, "context": seq_len, "skipped": "out of memory"}
            results[kind].append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return results


def print_tables(results: dict) -> None:
    print(f"{results['device']}: copy bandwidth {results['copy_bandwidth_gbs']:.0f} GB/s")
    print("\ndecode (fraction of copy bandwidth)")
    print(
        f"{'batch':>6} {'ctx':>6} {'splits':>6} {'triton':>8} {'nosplit':>8} {'slotmaj':>8} {'sdpa':>8} "
        f"{'vs sdpa':>8}"
    )
    for r in results["decode"]:
        if "skipped" in r:
            print(f"{r['batch']:>6} {r['context']:>6}  skipped: {r['skipped']}")
            continue
        print(
            f"{r['batch']:>6} {r['context']:>6} {r['num_splits']:>6} {r['triton_bw_frac']:>8.2f} "
            f"{r['triton_nosplit_bw_frac']:>8.2f} {r['triton_slot_major_bw_frac']:>8.2f} "
            f"{r['sdpa_bw_frac']:>8.2f} {r['speedup_vs_sdpa']:>7.2f}x"
        )
    print("\nprefill (TFLOP/s, counted causal; window / images: Gemma 3's masks, Triton vs SDPA ms)")
    print(
        f"{'batch':>6} {'ctx':>6} {'triton':>8} {'slotmaj':>8} {'sdpa':>8} {'vs sdpa':>8} "
        f"{'window':>15} {'images':>15}"
    )
    for r in results["prefill"]:
        if "skipped" in r:
            print(f"{r['batch']:>6} {r['context']:>6}  skipped: {r['skipped']}")
            continue
        print(
            f"{r['batch']:>6} {r['context']:>6} {r['triton_tflops']:>8.1f} "
            f"{r['triton_slot_major_tflops']:>8.1f} {r['sdpa_tflops']:>8.1f} {r['speedup_vs_sdpa']:>7.2f}x "
            f"{r['triton_window_ms']:>7.3f}/{r['sdpa_window_ms']:<7.3f} "
            f"{r['triton_images_ms']:>7.3f}/{r['sdpa_images_ms']:<7.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/kernels.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.kernels needs a CUDA GPU (none found); nothing measured.")
        return 0
    device = torch.device("cuda")
    decode_grid = [(b, c) for b in DECODE_BATCHES for c in CONTEXTS]
    prefill_grid = [(b, c) for b in PREFILL_BATCHES for c in CONTEXTS if b * c <= MAX_PREFILL_TOKENS]
    results = run(device, Shape(), decode_grid, prefill_grid)
    print_tables(results)
    save_json(args.out, results)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
