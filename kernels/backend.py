"""The attention-backend interface and the choice between backends.

A backend does two things per layer and step: write the new K/V into their slots, then compute
attention of the new queries over each sequence's paged K/V. Models call only these two methods,
so the torch path (CPU, reference), the CPU path (torch plus C attention kernels) and the Triton
path (GPU) are interchangeable.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

from mm_engine.kernels.cpu_kernels import CpuKernels
from mm_engine.kernels.metadata import AttentionMetadata

BACKENDS = ("auto", "triton", "cpu", "torch")


class AttentionBackend(Protocol):
    name: str

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # int64 [num_tokens]
    ) -> None: ...

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,  # sliding window of this layer (keys at positions > p - window)
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], dtype of query
        ...


def resolve_backend_name(name: str, device: torch.device) -> str:
    """Map `auto` to a concrete backend and check that the choice can run here."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        return "triton" if device.type == "cuda" else "cpu"
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "attention_backend='triton' needs a CUDA device; on CPU it runs only under the Triton "
            "interpreter (set TRITON_INTERPRET=1 before starting), which is for testing, not speed"
        )
    return name


def get_backend(name: str, device: torch.device, kernels: CpuKernels | None = None) -> AttentionBackend:
    """`kernels`: the CPU C kernels the "cpu" backend uses (kernels/cpu_kernels.py); without
    them "cpu" is the plain torch path."""
    name = resolve_backend_name(name, device)
    if name == "triton":
        from mm_engine.kernels.triton_backend import TritonBackend

        return TritonBackend()
    from mm_engine.kernels.torch_backend import TorchBackend

    # "cpu" is the torch path with attention through the C kernels where they build; "torch" is
    # the plain reference.
    return TorchBackend(kernels if name == "cpu" else None)
