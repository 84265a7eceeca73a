"""The MLPs' row chunks on CPU (models/layers/mlp.py `by_row_chunks`): chunked where the widest
temporary would be mmap-sized whole, into even chunks no smaller than the floor, and the output
the same as one pass; left whole where chunks would be too small to pay for reading the weights
again, and off the CPU."""

from __future__ import annotations

import types

import pytest
import torch

from mm_engine.models.layers import mlp
from mm_engine.models.layers.mlp import MLP, FeedForward, by_row_chunks


def _calls(rows: int, width: int) -> list[int]:
    seen: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.shape[0])
        return x[:, :3] * 2

    x = torch.randn(rows, 8)
    out = by_row_chunks(fn, x, width)
    torch.testing.assert_close(out, x[:, :3] * 2)
    return seen


def test_row_chunks_split_only_mmap_sized_temporaries_evenly():
    width = 6144  # Qwen2.5-VL's tower: gate and up side by side, float32: 24 KiB a row
    assert _calls(784, width) == [784]  # 19 MB: under glibc's 32 MiB, one pass
    assert _calls(3136, width) == [628] * 4 + [624]  # 77 MB: five chunks of about 16 MiB
    assert _calls(20_000, 37_888) == [20_000]  # chunks of ~110 rows would re-read the weights too often


def test_chunked_mlps_equal_one_pass(monkeypatch):
    torch.manual_seed(0)
    config = types.SimpleNamespace(hidden_size=32, intermediate_size=64, hidden_act="silu")
    gated = MLP(config, bias=True).eval()
    plain = FeedForward(32, 64, "gelu_pytorch_tanh", ("fc1", "fc2"), mlp.TORCH_OPS).eval()
    x = torch.randn(1000, 32)
    with torch.inference_mode():
        want = gated(x), plain(x)
        monkeypatch.setattr(mlp, "MMAP_BYTES", 4096)  # every call of 1000 rows chunked ...
        monkeypatch.setattr(mlp, "CHUNK_BYTES", 64 * 1024)  # ... into 4 (gated) and 4 (plain) chunks
        monkeypatch.setattr(mlp, "MIN_CHUNK_ROWS", 16)
        got = gated(x), plain(x)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the path off the CPU needs a CUDA device")
def test_off_the_cpu_one_pass():
    seen = []
    by_row_chunks(lambda x: seen.append(x.shape[0]) or x, torch.zeros(4096, 8, device="cuda"), 6144)
    assert seen == [4096]
