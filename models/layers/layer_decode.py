"""The C descriptions of a decoder layer's parts for their one-call forms (kernels/cpu_layer_decode.py),
built once after loading where the parts are what those calls run: float32 weights, the linears
packed for the C GEMMs of the ops' own library (`PanelLinear`, or `QuantLinear` on its panels
or its int8-input panels, without an input order), the fused input and gate/up projections, a SiLU
MLP, no tensor parallelism, and the ops using the C norms, SiLU-and-multiply and delta rule.

- Every layer's post-attention half (the residual add and norm, then the MLP; `layer.mlp_spec`)
  runs in one call on any step whose rows the MLP takes whole (`mlp_half`).
- A linear-attention layer (models/layers/hybrid.py) and a decoder layer's full attention with a
  fused q|k|v and a whole-head rotary (models/layers/decoder.py) run whole in one call on a step
  of decodes only (`layer.decode_spec`; for attention, where the backend's C decode and K/V write
  would take the step: `decode_rows`).
Anything else keeps its modules' path.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from mm_engine.kernels import cpu_decode, cpu_layer_decode, cpu_linear_attention, cpu_qgemm
from mm_engine.kernels.cpu_layer_decode import MmAttnLayer, MmDeltaLayer, MmLinear, MmMlp
from mm_engine.kernels.metadata import AttentionMetadata
from mm_engine.kernels.ops import CpuOps
from mm_engine.models.layers.mlp import MLP, MMAP_BYTES
from mm_engine.models.layers.packed_linear import PanelLinear
from mm_engine.models.layers.quant_linear import QuantLinear


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _float32(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() for t in tensors)


def layer_lib(ops, delta: bool = False, rotary: bool = False) -> ctypes.CDLL | None:
    """The library whose kernels a one-call form runs: the ops' own, where they use every kernel
    the call strings together (`delta`: the linear-attention ones too; `rotary`: the rotary)."""
    if not isinstance(ops, CpuOps) or not ops.kernels.uses("layer_decode"):
        return None
    if delta and not ops.c_delta or rotary and not ops.c_rotary:
        return None
    return ops.lib if ops.c_norm and ops.c_silu else None


def linear_spec(module: nn.Module, lib: ctypes.CDLL) -> MmLinear | None:
    if isinstance(module, PanelLinear) and module.lib is lib:
        return MmLinear(0, 0, module.out_features, module.in_features, module.panels.data_ptr(), None, None,
                        _ptr(module.bias))  # fmt: skip
    if not isinstance(module, QuantLinear) or module.lib is not lib:
        return None
    if module.perm is not None or module.triton:
        return None
    if module.a8 is not None:  # int8 inputs, rounded in the kernel as its forward has them
        p = module.a8
        return MmLinear(cpu_qgemm.KINDS[p.kind], p.group, p.n, p.k, p.weights.data_ptr(), _ptr(p.scales),
                        _ptr(p.zeros), _ptr(module.bias), 1, _ptr(p.wsum), _ptr(module.a8_scale))  # fmt: skip
    if module.panels is None or module.act is not None:
        return None
    p = module.panels
    return MmLinear(cpu_qgemm.KINDS[p.kind], p.group, p.n, p.k, p.weights.data_ptr(), _ptr(p.scales),
                    _ptr(p.zeros), _ptr(module.bias))  # fmt: skip


def mlp_spec(mlp: nn.Module, norm: nn.Module, lib: ctypes.CDLL) -> MmMlp | None:
    """The post-attention half: `norm` (the residual add and RMSNorm) and a gated SiLU `mlp`."""
    if not isinstance(mlp, MLP) or mlp.tp is not None or mlp.gate_up_proj is None or not mlp.silu:
        return None
    gate_up, down = linear_spec(mlp.gate_up_proj, lib), linear_spec(mlp.down_proj, lib)
    if gate_up is None or down is None or not _float32(norm.weight):
        return None
    return MmMlp(gate_up, down, norm.weight.data_ptr(), norm.eps, mlp.width)


def delta_layer_spec(layer: nn.Module) -> MmDeltaLayer | None:
    """A hybrid model's linear-attention layer (models/layers/hybrid.py `HybridLayer`), or None."""
    attn = layer.linear_attn
    lib = layer_lib(attn.ops, delta=True)
    if lib is None or attn.tp is not None or attn.in_proj is None:
        return None
    if max(attn.key_dim, attn.value_dim) > cpu_linear_attention.MAX_DIM:
        return None
    conv = attn.conv1d.weight[:, 0]
    norms = (layer.input_layernorm.weight, attn.norm.weight)
    if not _float32(conv, attn.A_log, attn.dt_bias, *norms):
        return None
    in_proj, out_proj = linear_spec(attn.in_proj, lib), linear_spec(attn.out_proj, lib)
    mlp = mlp_spec(layer.mlp, layer.post_attention_layernorm, lib)
    if in_proj is None or out_proj is None or mlp is None:
        return None
    hidden = layer.input_layernorm.weight.shape[0]
    pointers = (t.data_ptr() for t in (norms[0], conv, attn.A_log, attn.dt_bias, norms[1]))
    return MmDeltaLayer(
        in_proj, out_proj, *pointers, layer.input_layernorm.eps, attn.norm.eps, hidden, attn.heads,
        attn.key_heads, attn.key_dim, attn.value_dim, conv.shape[1], mlp,
    )  # fmt: skip


def attn_layer_spec(layer: nn.Module, mlp: MmMlp | None) -> MmAttnLayer | None:
    """A decoder layer's full attention (models/layers/decoder.py `Attention`) with its MLP half
    `mlp`, or None."""
    from mm_engine.models.layers.decoder import Attention  # (decoder.py imports this module)

    attn = layer.self_attn
    if mlp is None or not isinstance(attn, Attention) or attn.tp is not None or attn.pairs is not None:
        return None
    lib = layer_lib(attn.ops, rotary=True)
    qkv = None if lib is None or attn.qkv_proj is None else linear_spec(attn.qkv_proj, lib)
    o = None if qkv is None else linear_spec(attn.o_proj, lib)
    group, dim = attn.num_heads // attn.num_kv_heads, attn.head_dim
    if o is None or group > cpu_decode.MAX_GROUP or dim > cpu_decode.MAX_DIM or dim % 2:
        return None
    norms = [layer.input_layernorm] + ([attn.q_norm, attn.k_norm] if attn.q_norm is not None else [])
    if not _float32(*(n.weight for n in norms)):
        return None
    q_norm, k_norm = (attn.q_norm, attn.k_norm) if attn.q_norm is not None else (None, None)
    return MmAttnLayer(
        qkv, o, layer.input_layernorm.weight.data_ptr(), None if q_norm is None else q_norm.weight.data_ptr(),
        None if k_norm is None else k_norm.weight.data_ptr(), layer.input_layernorm.eps,
        0.0 if q_norm is None else q_norm.eps, attn.scale, layer.input_layernorm.weight.shape[0],
        attn.num_heads, attn.num_kv_heads, dim, mlp,
    )  # fmt: skip


def attention_layer(
    layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, backend,
) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
    """A decoder layer's whole decode step in one call (`layer.decode_spec`): `(out, residual)` as
    its modules return them; None (nothing done) where the step is not decodes only, in order,
    through the backend's C decode and K/V write of the same library, or the rows are not the
    float32 ones the call takes."""
    spec, lib = layer.decode_spec, layer.mlp.ops.lib
    rows_of = getattr(backend, "decode_rows", None)
    if rows_of is None or getattr(backend, "lib", None) is not lib:
        return None
    rows = rows_of(meta, k_cache, v_cache)
    m = x.shape[0]
    if rows is None or rows.slots.shape[0] != m or m * 2 * layer.mlp.width * 4 >= MMAP_BYTES:
        return None
    cos, sin = rope
    if cos.shape[-1] * 2 != spec.dim or not _float32(x, cos, sin, *(() if residual is None else (residual,))):
        return None
    return cpu_layer_decode.attn_layer_decode(lib, spec, x, residual, rope, k_cache, v_cache, rows)


# GLM's norms around the MLP half: such a layer keeps its modules' path there.
SANDWICH_NORMS = ("post_self_attn_layernorm", "post_mlp_layernorm")


def mlp_half(
    layer: nn.Module, residual: torch.Tensor, attn: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`residual += attn`, then the MLP of its norm, in one call: `(out, residual)` as the modules
    return them; None (nothing done) where the rows are more than the MLP takes whole (past that
    its modules run it in row chunks, whose sums these would not be) or not float32 rows."""
    rows = residual.shape[0]
    if residual.dim() != 2 or rows * 2 * layer.mlp.width * 4 >= MMAP_BYTES:
        return None
    if not (_float32(residual, attn) and attn.shape == residual.shape):
        return None
    return cpu_layer_decode.mlp_decode(layer.mlp.ops.lib, layer.mlp_spec, residual, attn)


def prepare(language_model: nn.Module) -> int:
    """Describe every layer part that can run in one call (`layer.mlp_spec`, and the whole layer's
    `layer.decode_spec`); returns how many layers have one."""
    count = 0
    for layer in getattr(language_model, "layers", []):
        if not hasattr(layer, "mlp_spec"):
            continue
        if getattr(layer, "linear", False):
            layer.decode_spec = delta_layer_spec(layer)
        lib = layer_lib(getattr(layer.mlp, "ops", None))
        sandwich = any(getattr(layer, n, None) is not None for n in SANDWICH_NORMS)
        if lib is not None and not sandwich:
            layer.mlp_spec = mlp_spec(layer.mlp, layer.post_attention_layernorm, lib)
            if not getattr(layer, "linear", False):  # a decoder layer (a hybrid one's attention: gated)
                layer.decode_spec = attn_layer_spec(layer, layer.mlp_spec)
        count += layer.mlp_spec is not None or getattr(layer, "decode_spec", None) is not None
    return count
