"""Engine arguments: one dataclass, validated once, shared by `LLM`, the server and the CLI."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CPU_DEFAULT_KV_BYTES = 2 * 1024**3
# `quantization` on load: weight-only, or (w8a8, w4a8) int8 or int4 weights with the inputs rounded
# to int8 per token as well (vLLM's W8A8 dynamic; integer dot products on AVX-512 VNNI, and for
# int4 weights on AVX2)
WEIGHT_KINDS = ("bf16", "fp8", "int8", "int4")  # what the low-bit GEMMs store
QUANTIZATIONS = (*WEIGHT_KINDS, "w8a8", "w4a8")


def default_model_path() -> Path:
    """The small demo model shipped inside the package, used wherever a model is optional."""
    path = Path(__file__).parent / "demo" / "demo_model"
    if not (path / "config.json").is_file():
        raise ValueError("no model given and the embedded demo model is not installed; pass a model")
    return path


CPU_DECODE_STEP_PREFILL_TOKENS = 768  # bench.serve, 64 streams: p99 ITL 0.47x, throughput 0.97x


@dataclass(slots=True)
class EngineConfig:
    model: str
    device: str = "auto"  # "auto": CUDA when available, else CPU
    dtype: str = "auto"  # LM dtype; "auto": float16 on CUDA, float32 on CPU (CPU half matmul is ~100x slower)
    vision_dtype: str = "auto"  # vision tower dtype; "auto": float16 on CUDA, float32 on CPU
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # None: gpu_memory_utilization on CUDA, 2 GiB on CPU
    gpu_memory_utilization: float = 0.9
    image_pool_fraction: float = 0.5
    # Hybrid (linear-attention) models: the recurrent-state pool takes at most this share of the KV
    # memory; it holds a slot for each of min(max_num_seqs, what fits) running sequences.
    max_state_memory_fraction: float = 0.5
    # Rows of that memory kept for state snapshots (prefix reuse of hybrid models); None: as many
    # as there are slots, when prefix caching is on.
    num_state_snapshots: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    attention_backend: str = "auto"
    # CPU: the C kernels' ISA variant (avx512, avx2, portable); None: $MM_ENGINE_CPU_VARIANT, else
    # the widest this CPU runs. A variant the CPU lacks is refused.
    cpu_kernel_variant: str | None = None
    # CPU: which C kernels run ("all", "none", "measured" or names: "decode,prefill,gemm"); None:
    # $MM_ENGINE_CPU_KERNELS, else "measured" (those measured faster on the variant).
    cpu_kernels: str | None = None
    cpu_packed_weights: bool = True  # CPU: linears through oneDNN with weights packed at load time
    # The language model's linear layers (not the vision tower, the embeddings or the LM head)
    # rounded on load to "bf16", "fp8", "int8" or "int4" weights (weight-only; a scale per row and
    # group of 128 inputs), or "w8a8" / "w4a8" (int8 / int4 weights, inputs rounded to int8 per
    # token), computed by the CPU's low-bit GEMMs (models/layers/quant_linear.py).
    quantization: str | None = None
    quantize_lm_head: bool = False  # the LM head too (it is a large share of a small model's bytes)
    # CPU: keep freed tensor memory in glibc's heap (mm_engine.pools.cpu_memory). It changes the whole
    # process's malloc, so a library caller opts in; the `mm-engine` commands turn it on.
    cpu_tune_malloc: bool = False
    cpu_huge_pages: bool = False  # CPU: the KV pool on transparent huge pages (mm_engine.pools.cpu_memory)
    scheduling_policy: str = "priority"  # or "fcfs"
    image_priority_boost: float = 0.5  # how far an image request goes ahead of text of equal priority
    max_wait_s: float = 30.0  # a request waiting this long goes ahead of everyone who waited less
    preemption_margin: float = 1.0  # rank a waiting request must beat a running one by to preempt it
    # Requests at this priority or above are background work (the batch API's): they never age
    # ahead of others, go after every other request and are preempted first. None: no such tier.
    background_priority: int | None = 10
    # In a step that runs foreground work, background requests compute at most this many tokens
    # (0: they wait for a step with none), so a batch never slows interactive streams down.
    background_step_tokens: int = 0
    # A step of background work alone adds at most this many prefill tokens (or one image, or with
    # sliced_encoding a share of a bigger image's tower), so a request arriving while a batch runs
    # waits for one short step.
    background_prefill_tokens: int = 256
    # Such a step gives way before its next layer when a request arrives, and goes on once the
    # foreground steps are done (core/background_yield.py; plain loop, one rank, core process).
    background_yield: bool = True
    # Each step sets aside a token for every running decode before better-ranked prefills are
    # admitted (vLLM's order); False: strict rank order, where a new image prefill may take the
    # whole step and running streams wait for it.
    decode_first: bool = True
    # Structured output: specs over these are refused before compiling (core/grammar_limits.py);
    # a compile that takes longer than the timeout is a 400; compiled grammars cached up to the bytes.
    # Each new spec is first compiled in a process of its own, stopped past the timeout or the
    # memory (core/grammar_probe.py); 0: no such trial (a compile then cannot be stopped).
    max_grammar_bytes: int = 64 * 1024
    max_grammar_entries: int = 1000
    max_grammar_depth: int = 64
    grammar_compile_timeout_s: float = 5.0
    grammar_compile_memory_bytes: int = 2 * 1024**3
    grammar_cache_bytes: int = 512 * 1024**2
    preemption_mode: str = "recompute"  # or "swap": KV to host memory, image blocks kept first
    # With running decodes, the prefill tokens (and, beyond one image or with sliced_encoding a share
    # of a bigger one, the image tokens encoded) a step may add: it bounds how long running streams
    # wait for their next token (Sarathi-Serve's token budget). None: 768 on CPU (bench.serve,
    # docs/benchmarks.md), no cap on GPU (not yet measured there); 0: no cap.
    decode_step_prefill_tokens: int | None = None
    # The same bound in time: a step with running decodes adds the prefill and encoding that its
    # measured costs (sched/step_costs.py) say keep it within this factor of its decodes alone
    # (2.0: the streams' next token waits at most about twice as long as with no prefill). Both
    # bounds apply where both are set. None: not bounded in time.
    step_time_factor: float | None = None
    # An image bigger than what such a bounded step may encode is encoded a share of its tower's
    # layers a step (vision/sliced_encode.py) instead of whole in one step: one big image then
    # delays the streams' next token by a share of its tower, not all of it. Off: whole, as before.
    sliced_encoding: bool = True
    swap_space_bytes: int = 4 * 1024**3
    enable_prefix_caching: bool = True
    encoder_cache_bytes: int = 256 * 1024**2
    # With the core in its own process: image pixels it keeps per frontend, by content hash, so a
    # repeated image crosses once (core/pixels.py).
    ipc_pixel_cache_bytes: int = 512 * 1024**2
    max_num_encoder_tokens: int | None = None  # image tokens encoded per step; None: budget or one image
    max_image_tokens: int | None = None  # prompt tokens one image may take; None: max_model_len // 4
    mm_processor_kwargs: dict | None = None  # processor options, e.g. {"max_pixels": 1003520} (Qwen)
    kv_watermark: float = 0.01  # fraction of each pool kept free when admitting new requests
    max_waiting_requests: int = 10_000
    # Overlapped scheduling: step N+1 is scheduled and prepared while step N computes, and step N's
    # tokens are handed back meanwhile (core/launcher.py). None: on where it is measured to pay.
    async_scheduling: bool | None = None
    async_launch: str = "auto"  # "inline" (queued on the CUDA stream) or "thread"; auto: by device
    # Tensor parallelism: the language model split over this many ranks (mm_engine/parallel):
    # rank 0 is the engine core, the others worker processes (cuda:rank on a GPU, gloo on CPU).
    tensor_parallel_size: int = 1
    tensor_parallel_always: bool = False  # the parallel code path even at size 1 (a check of it)
    # Under TP, the vision tower: "data", whole on every rank, a step's images split over them
    # (parallel/vision_dp.py); "rank0", on rank 0 alone (the workers hold none).
    mm_encoder_tp_mode: str = "data"
    data_parallel_rank: int = 0  # which engine core this is (set per core): its GPUs follow the earlier's
    # torch threads of an engine-core process (and of each tensor-parallel worker) of its own; None:
    # torch's default, or with several cores and ranks on one CPU machine their share of its cores.
    cpu_threads: int | None = None
    seed: int = 0

    def prefill_cap(self, device_type: str) -> int | None:
        """The prefill tokens a step adds beside decodes: as configured (0: no cap), else the
        platform's (`CPU_DECODE_STEP_PREFILL_TOKENS` on CPU, none on GPU: not measured there)."""
        if self.decode_step_prefill_tokens is not None:
            return self.decode_step_prefill_tokens or None
        return CPU_DECODE_STEP_PREFILL_TOKENS if device_type == "cpu" else None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 <= self.image_pool_fraction < 1.0:
            raise ValueError(f"image_pool_fraction must be in [0, 1), got {self.image_pool_fraction}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_grammar_bytes", "max_grammar_entries",
                     "max_grammar_depth", "grammar_cache_bytes"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.step_time_factor is not None and not self.step_time_factor > 1.0:
            raise ValueError(f"step_time_factor must be above 1.0, got {self.step_time_factor}")
        if self.decode_step_prefill_tokens is not None and self.decode_step_prefill_tokens < 0:
            raise ValueError(
                f"decode_step_prefill_tokens must be at least 0, got {self.decode_step_prefill_tokens}"
            )
        if self.grammar_compile_memory_bytes < 0:
            raise ValueError(
                f"grammar_compile_memory_bytes must be at least 0, got {self.grammar_compile_memory_bytes}"
            )
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(
                f"grammar_compile_timeout_s must be positive, got {self.grammar_compile_timeout_s}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS} (or None), got {self.quantization!r}"
            )
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.async_launch not in ("auto", "inline", "thread"):
            raise ValueError(f"async_launch must be 'auto', 'inline' or 'thread', got {self.async_launch!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be at least 1, got {self.cpu_threads}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size!r}")
        if self.mm_encoder_tp_mode not in ("data", "rank0"):
            got = self.mm_encoder_tp_mode
            raise ValueError(f"mm_encoder_tp_mode must be 'data' or 'rank0' (no sharded tower), got {got!r}")
        if self.num_state_snapshots is not None and self.num_state_snapshots < 0:
            raise ValueError(f"num_state_snapshots must be at least 0, got {self.num_state_snapshots}")
        if not 0.0 < self.max_state_memory_fraction < 1.0:
            got = self.max_state_memory_fraction
            raise ValueError(f"max_state_memory_fraction must be in (0, 1), got {got}")
        if not 0.0 <= self.kv_watermark < 0.5:
            raise ValueError(f"kv_watermark must be in [0, 0.5), got {self.kv_watermark}")
        if self.max_image_tokens is not None and self.max_image_tokens < 1:
            raise ValueError(f"max_image_tokens must be at least 1, got {self.max_image_tokens}")
        if self.mm_processor_kwargs is not None and not isinstance(self.mm_processor_kwargs, dict):
            raise ValueError("mm_processor_kwargs must be a dict of processor options")
        if self.background_step_tokens < 0 or self.background_prefill_tokens < 1:
            raise ValueError(
                "background_step_tokens must be at least 0 and background_prefill_tokens at least 1"
            )
        for name in ("encoder_cache_bytes", "max_waiting_requests", "ipc_pixel_cache_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        for name in ("dtype", "vision_dtype"):
            if getattr(self, name) not in ("auto", *_DTYPES):
                raise ValueError(
                    f"{name} must be 'auto' or one of {sorted(_DTYPES)}, got {getattr(self, name)!r}"
                )

    @property
    def parallel(self) -> bool:
        """Whether the language model runs tensor-parallel (over rank 0 and worker processes)."""
        return self.tensor_parallel_size > 1 or self.tensor_parallel_always

    @classmethod
    def from_kwargs(cls, model: str | None, **kwargs) -> EngineConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(model=str(default_model_path()) if model is None else model, **kwargs)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but CUDA is not available")
        return dev

    def torch_dtype(self, which: str = "dtype") -> torch.dtype:
        name = getattr(self, which)
        if name == "auto":
            return torch.float16 if self.torch_device().type == "cuda" else torch.float32
        return _DTYPES[name]
