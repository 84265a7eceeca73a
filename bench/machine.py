"""What this machine can do, measured by the benchmark itself, and what a LLaVA job needs of it.

The figures of merit of bench.offline and bench.roofline are fractions of a floor: the FLOPs (or
bytes) a job needs divided by the machine's measured fp32 matmul rate (or memory bandwidth). The
rates are measured here, in the same run and with the same thread count as the benchmark, so the
fraction holds on a noisy machine as well as it can. FLOPs count the matmuls (and attention's
two products) a forward pass must do; norms, activations and softmax are not counted.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass

import torch

from mm_engine.models.layers.packed_linear import PackedLinear, can_pack
from mm_engine.models.layers.vision_layout import tower_layout
from mm_engine.models.llava import feature_layers, tokens_per_image


def best_seconds(fn, reps: int) -> float:
    fn()  # warm-up: first-call allocations, thread pool start
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def matmul_flops_per_s(
    sizes: tuple[int, ...] = (1024, 2048, 3072), reps: int = 3, device: str = "cpu", dtype=torch.float32
) -> float:
    """The best fp32 GEMM rate over a few square sizes and both of torch's CPU GEMM libraries
    (MKL through `torch.mm`, oneDNN with a packed weight as the engine's linears use it): the
    machine's practical compute peak. Taking the better library keeps a fraction of it honest
    (at or below 100%) whichever library a contender uses. On a GPU: cuBLAS at `dtype`."""
    if torch.device(device).type == "cuda":
        return _gpu_matmul_flops_per_s(sizes, reps, torch.device(device), dtype)
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        out = torch.empty(n, n)
        best = max(best, 2 * n**3 / best_seconds(lambda a=a, b=b, out=out: torch.mm(a, b, out=out), reps))
        linear = torch.nn.Linear(n, n, bias=False)
        if can_pack(linear):
            packed = PackedLinear(linear)
            best = max(best, 2 * n**3 / best_seconds(lambda a=a, packed=packed: packed(a), reps))
    return best


def _gpu_matmul_flops_per_s(sizes, reps: int, device: torch.device, dtype) -> float:
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)

        def ten(a=a, b=b) -> None:  # ten products per timing, so launch and sync costs vanish
            for _ in range(10):
                torch.mm(a, b)
            torch.cuda.synchronize(device)

        best = max(best, 10 * 2 * n**3 / best_seconds(ten, reps))
    return best


def memory_bytes_per_s(mib: int = 512, reps: int = 5) -> float:
    """Read bandwidth: summing a tensor far larger than the caches, as decode streams the weights."""
    x = torch.ones(mib * 1024**2 // 4)
    return x.numel() * 4 / best_seconds(lambda: x.sum(), reps)


def machine_info() -> dict:
    return {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": _cpu_name(),
        **_cpu_kind(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        **({"gpu": torch.cuda.get_device_name()} if torch.cuda.is_available() else {}),
    }


# Vector extensions a figure depends on, as /proc/cpuinfo spells them.
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")


def _cpu_kind() -> dict:
    """The CPU's family/model and vector extensions: a VM's "AMD EPYC" alone does not say which
    generation a figure came from (AMD family 25 is Zen 3 or Zen 4 by model, 26 is Zen 5)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
                if key.strip() == "flags":
                    break
    except OSError:
        return {}
    family, model = int(fields.get("cpu family", "0")), int(fields.get("model", "0"))
    out = {
        "cpu_family_model": f"{family}/{model}",
        "isa": [f for f in ISA_FLAGS if f in fields.get("flags", "").split()],
    }
    if fields.get("vendor_id") == "AuthenticAMD":
        zen4 = family == 25 and (0x10 <= model <= 0x1F or 0x60 <= model <= 0x7F or 0xA0 <= model <= 0xAF)
        generation = {23: "Zen/Zen 2", 25: "Zen 4" if zen4 else "Zen 3", 26: "Zen 5"}.get(family)
        if generation:
            out["cpu_generation"] = generation
    return out


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass(frozen=True)
class LlavaFlops:
    """FLOP counts of one LLaVA model, from its Hugging Face config."""

    vision_per_image: float
    lm_linear_per_token: float  # every projection and MLP of every layer, for one token
    lm_attn_per_key: float  # attention's two products, per (query token, key) pair, all layers
    lm_head_per_token: float
    kv_bytes_per_token: int  # K and V of all layers, float32
    lm_weight_bytes: int  # decoder layers and the head, float32

    @classmethod
    def from_config(cls, cfg) -> LlavaFlops:
        vc, tc = cfg.vision_config, cfg.text_config
        t = (vc.image_size // vc.patch_size) ** 2 + (1 if vc.model_type == "clip_vision_model" else 0)
        h, i = vc.hidden_size, vc.intermediate_size
        layer = 2 * t * (4 * h * h + 2 * h * i) + 4 * t * t * h
        patch = 2 * (t - (vc.model_type == "clip_vision_model")) * 3 * vc.patch_size**2 * h
        th, read = tc.hidden_size, feature_layers(cfg)
        # Only the layers up to the deepest one LLaVA reads need to run; the projector sees the
        # image tokens the LM gets (CLIP's class token dropped under the "default" strategy).
        projector = 2 * tokens_per_image(cfg) * (h * len(read) * th + th * th)
        return cls.language_model(tc, float(patch + max(read) * layer + projector))

    @classmethod
    def language_model(cls, tc, vision_per_image: float = 0.0) -> LlavaFlops:
        """The decoder's counts from a text config (any family with a Llama-shaped decoder)."""
        th = tc.hidden_size
        hd = getattr(tc, "head_dim", None) or th // tc.num_attention_heads
        q, kv = tc.num_attention_heads * hd, tc.num_key_value_heads * hd
        per_layer = th * q + 2 * th * kv + q * th + 3 * th * tc.intermediate_size
        n = tc.num_hidden_layers
        return cls(
            vision_per_image=vision_per_image,
            lm_linear_per_token=float(2 * n * per_layer),
            lm_attn_per_key=float(4 * n * q),
            lm_head_per_token=float(2 * th * tc.vocab_size),
            kv_bytes_per_token=2 * n * kv * 4,
            lm_weight_bytes=4 * (n * per_layer + th * tc.vocab_size),
        )

    def tokens(self, first: int, count: int) -> float:
        """FLOPs to run tokens at positions first .. first+count-1 through the decoder (no head):
        the token at position p attends to p + 1 keys."""
        keys = count * first + count * (count + 1) / 2
        return count * self.lm_linear_per_token + keys * self.lm_attn_per_key

    def request(self, prompt_len: int, output_len: int, cached: int = 0, images: int = 1) -> float:
        """The least work for one request: its images, its prompt beyond `cached` reused tokens,
        the head once per output token, and a forward for every output token but the last."""
        return (
            images * self.vision_per_image
            + self.tokens(cached, prompt_len - cached)
            + self.tokens(prompt_len, max(0, output_len - 1))
            + output_len * self.lm_head_per_token
        )

    def decode_step(self, batch: int, context: int) -> tuple[float, float]:
        """(FLOPs, bytes) of one decode step of `batch` sequences each with `context` cached
        tokens: the weights are read once, each sequence's KV once."""
        flops = batch * (self.tokens(context, 1) + self.lm_head_per_token)
        return flops, self.lm_weight_bytes + batch * (context + 1) * self.kv_bytes_per_token


def qwen_tower_flops(vc, grid: tuple[int, int, int]) -> float:
    """FLOPs of a Qwen2-VL or Qwen2.5-VL tower on one image of patch grid (t, h, w): the patch
    embedding, every block's projections and attention products (within frames, or windows in
    Qwen2.5's windowed layers), the merger."""
    t, h, w = grid
    p, m = t * h * w, vc.spatial_merge_size
    gated = vc.model_type == "qwen2_5_vl_vision"
    c = vc.hidden_size if gated else vc.embed_dim
    mlp = 3 * c * vc.intermediate_size if gated else 2 * c * int(c * vc.mlp_ratio)
    out = vc.out_hidden_size if gated else vc.hidden_size
    window = vc.window_size // vc.patch_size // m if gated else None
    layout = tower_layout([grid], m, window)
    full = set(vc.fullatt_block_indexes) if gated else set(range(vc.depth))
    attention = 0
    for layer in range(vc.depth):
        segments = layout.frames if layer in full else layout.windows
        attention += 4 * c * sum(n * n for n in segments.lens)
    patch = 2 * p * vc.in_channels * vc.temporal_patch_size * vc.patch_size**2 * c
    merger = 2 * (p // (m * m)) * ((c * m * m) ** 2 + c * m * m * out)
    return float(patch + vc.depth * 2 * p * (4 * c * c + mlp) + attention + merger)
