"""Host data onto the device without waiting for the device.

A plain copy from pageable host memory to CUDA waits until everything queued on the stream has
run, the forward in flight included: with overlapped scheduling that would serialise the host's
preparation of the next step behind the current one. Pinned memory and `non_blocking` queue the
copy instead (the caching host allocator keeps the pinned buffer alive until the copy is done).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(data: Sequence | torch.Tensor, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """`data` (a list or a CPU tensor) as a tensor on `device`, queued rather than waited for on CUDA."""
    cuda = device.type == "cuda"
    if isinstance(data, torch.Tensor):
        t = data if dtype is None else data.to(dtype)
        return t.pin_memory().to(device, non_blocking=True) if cuda else t.to(device)
    if not cuda:
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
