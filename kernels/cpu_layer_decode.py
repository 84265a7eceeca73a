"""A decoder layer's decode step in one C call (`cpu_layer_decode.c`): the structs that describe a
layer's weights to it, built once per layer, and the calls that run a step's rows through it.

The structs hold raw pointers into the layer's tensors (packed panels, norm weights); whoever
builds one keeps the tensors alive as long as it (models/layers/layer_decode.py keeps them on the
module that owns them)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

_P, _F = ctypes.c_void_p, ctypes.c_float


class MmLinear(ctypes.Structure):
    """One linear layer: kind 0 float32 panels (cpu_gemm.py), else a cpu_qgemm.py KINDS value; with
    `a8`, cpu_qgemm_a8.py's panels for int8 inputs."""

    _fields_ = [
        ("kind", ctypes.c_int), ("group", ctypes.c_int), ("n", ctypes.c_int), ("k", ctypes.c_int),
        ("weights", _P), ("scales", _P), ("zeros", _P), ("bias", _P),
        ("a8", ctypes.c_int), ("wsum", _P), ("static_scale", _P),
    ]  # fmt: skip


class MmMlp(ctypes.Structure):
    _fields_ = [("gate_up", MmLinear), ("down", MmLinear), ("norm", _P), ("eps", _F), ("width", ctypes.c_int)]


class MmDeltaLayer(ctypes.Structure):
    _fields_ = [
        ("in_proj", MmLinear), ("out_proj", MmLinear),
        ("in_norm", _P), ("conv_weight", _P), ("a_log", _P), ("dt_bias", _P), ("gate_norm", _P),
        ("eps", _F), ("gate_eps", _F),
        ("hidden", ctypes.c_int), ("heads", ctypes.c_int), ("key_heads", ctypes.c_int), ("dk", ctypes.c_int),
        ("dv", ctypes.c_int), ("conv_width", ctypes.c_int),
        ("mlp", MmMlp),
    ]  # fmt: skip


class MmAttnLayer(ctypes.Structure):
    _fields_ = [
        ("qkv", MmLinear), ("o", MmLinear), ("in_norm", _P), ("q_norm", _P), ("k_norm", _P),
        ("eps", _F), ("qk_eps", _F), ("scale", _F),
        ("hidden", ctypes.c_int), ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int), ("dim", ctypes.c_int),
        ("mlp", MmMlp),
    ]  # fmt: skip


class MmKvRows(ctypes.Structure):
    _fields_ = [
        ("k_cache", _P), ("v_cache", _P),
        ("block_stride", ctypes.c_int64), ("slot_stride", ctypes.c_int64), ("head_stride", ctypes.c_int64),
        ("block_size", ctypes.c_int), ("max_len", ctypes.c_int),
        ("slots", _P), ("tables", _P), ("table_stride", ctypes.c_int64), ("lens", _P),
    ]  # fmt: skip


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """A step whose every row is one sequence's decode, in order (the attention backend's answer,
    kernels/torch_backend.py `decode_rows`): each row's pool slot (int64), the sequences' block
    tables and lengths (int32, contiguous) and the longest length."""

    slots: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor
    max_len: int


def mlp_scratch(mlp: MmMlp, hidden: int) -> int:
    """Floats of scratch the MLP half takes per row."""
    return hidden + 3 * mlp.width


def delta_layer_scratch(layer: MmDeltaLayer) -> int:
    """Floats of scratch a linear-attention layer takes per row."""
    return 2 * layer.hidden + layer.in_proj.n + layer.heads * layer.dv + mlp_scratch(layer.mlp, layer.hidden)


def attn_layer_scratch(layer: MmAttnLayer) -> int:
    """Floats of scratch a full-attention layer takes per row."""
    heads, kv_heads = layer.heads * layer.dim, layer.kv_heads * layer.dim
    return 2 * layer.hidden + layer.qkv.n + 2 * heads + kv_heads + mlp_scratch(layer.mlp, layer.hidden)


def mlp_decode(
    lib: ctypes.CDLL, mlp: MmMlp, residual: torch.Tensor, mixed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual += mixed`, then the MLP of its norm: `(out, residual)`. Both `[M, hidden]`
    float32, contiguous."""
    rows, hidden = residual.shape
    scratch = torch.empty(rows * mlp_scratch(mlp, hidden))
    out = torch.empty(rows, hidden)
    failed = lib.mlp_decode(
        ctypes.addressof(mlp), residual.data_ptr(), mixed.data_ptr(), scratch.data_ptr(), out.data_ptr(),
        hidden, rows, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("a decoder layer's decode could not allocate its kernels' scratch")
    return out, residual


def delta_layer_decode(
    lib: ctypes.CDLL, layer: MmDeltaLayer, x: torch.Tensor, residual: torch.Tensor | None,
    conv: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A linear-attention layer's decode of `x` `[M, hidden]` (one token of each of M sequences,
    in the state pool rows `slots`, int64): `(out, residual)` as the layer's modules return them
    (without a residual, x becomes it). Every tensor float32, contiguous, on the CPU."""
    rows = x.shape[0]
    scratch = torch.empty(rows * delta_layer_scratch(layer))
    out = torch.empty(rows, layer.hidden)
    failed = lib.delta_layer_decode(
        ctypes.addressof(layer), x.data_ptr(), None if residual is None else residual.data_ptr(),
        conv.data_ptr(), state.data_ptr(), slots.data_ptr(), scratch.data_ptr(), out.data_ptr(), rows,
        torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("a decoder layer's decode could not allocate its kernels' scratch")
    return out, x if residual is None else residual


def attn_layer_decode(
    lib: ctypes.CDLL, layer: MmAttnLayer, x: torch.Tensor, residual: torch.Tensor | None,
    rope: tuple[torch.Tensor, torch.Tensor], k_cache: torch.Tensor, v_cache: torch.Tensor, rows: DecodeRows,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A full-attention layer's decode of `x` `[M, hidden]`, one token of each sequence of `rows`:
    its keys and values written into the pool (`k_cache`, `v_cache`: the `[blocks, slots, kv_heads,
    dim]` views of head-major storage), `(out, residual)` as the modules return them. `rope`: the
    step's (cos, sin), `[M, 1, dim // 2]` contiguous. Every tensor float32 on the CPU."""
    m = x.shape[0]
    kv = MmKvRows(
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1], rows.max_len, rows.slots.data_ptr(), rows.tables.data_ptr(), rows.tables.stride(0),
        rows.lens.data_ptr(),
    )  # fmt: skip
    scratch = torch.empty(m * attn_layer_scratch(layer))
    out = torch.empty(m, layer.hidden)
    failed = lib.attn_layer_decode(
        ctypes.addressof(layer), x.data_ptr(), None if residual is None else residual.data_ptr(),
        rope[0].data_ptr(), rope[1].data_ptr(), ctypes.addressof(kv), scratch.data_ptr(), out.data_ptr(), m,
        torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("a decoder layer's decode could not allocate its kernels' scratch")
    return out, x if residual is None else residual
