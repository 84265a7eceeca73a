"""What a failed `step()` tells its caller: which requests it dropped, and whether the device is
still usable.

A step that raises part-way leaves the requests it held half-updated (KV written for some layers,
tokens not appended), so the engine drops exactly those, freeing their blocks, and leaves every
other request as it was. A fault of the device itself (a CUDA error: an illegal address, a
device-side assert) leaves the CUDA context unusable for everyone, so it is reported as such and
the caller must stop stepping; running out of memory is not one of those.
"""

from __future__ import annotations

import torch

from mm_engine.parallel.group import ParallelError

# Messages of CUDA-side failures that torch raises as a plain RuntimeError.
# A tensor-parallel collective whose peer died breaks the group for good as well.
_DEVICE_MARKERS = ("CUDA error", "CUBLAS_STATUS", "cuDNN error", "CUDA driver error", "NCCL error",
                   "Connection closed by peer", "Gloo", "gloo")  # fmt: skip


class StepFailedError(RuntimeError):
    """`step()` failed; `request_ids` were dropped (blocks freed); the others are untouched."""

    def __init__(self, request_ids: list[str], device_lost: bool) -> None:
        what = "device fault" if device_lost else "step failed"
        super().__init__(f"engine {what}; dropped {len(request_ids)} request(s)")
        self.request_ids = request_ids
        self.device_lost = device_lost


def is_device_fault(exc: BaseException) -> bool:
    """Does `exc` leave the accelerator unusable (as opposed to failing one batch)?"""
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    if isinstance(exc, torch.AcceleratorError | ParallelError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _DEVICE_MARKERS)
