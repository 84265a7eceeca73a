"""Which part of each language-model weight a tensor-parallel rank holds (Megatron's split):
q, k, v, gate and up by output rows (heads, columns), o_proj and down by input columns, the
embedding and the LM head by vocabulary rows; norms whole. Experts (MoE) split the same way
inside each expert; the router is whole. A linear-attention layer (Qwen3.5) splits by its key
and value heads: in_proj_qkv and the conv hold q, k and v channels one after the other, so each
of the three parts is split; z, beta, the decay's parameters by value heads; out_proj by rows.
A row-parallel layer's bias is added once, after the sum over ranks: rank 0 holds it, the others
zeros."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from mm_engine.parallel.group import TPGroup

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "in_proj_z", "in_proj_b", "in_proj_a")
ROW = ("o_proj", "down_proj", "out_proj")  # split the input (dim 1)
SEGMENTED = ("in_proj_qkv", "conv1d")  # q | k | v channels, each part split (dim 0)
PER_HEAD = ("dt_bias", "A_log")  # a linear-attention layer's per-value-head parameters
VOCAB = ("embed_tokens.weight", "lm_head.weight")


def shard_state(state: dict, lm: nn.Module, tp: TPGroup) -> dict[str, torch.Tensor]:
    """This rank's tensors for `lm` (built with `tp`), reading only its shard of each reference."""
    shapes = {k: tuple(v.shape) for k, v in lm.state_dict().items()}
    out = {}
    for key, ref in state.items():
        want = shapes.get(key)
        if want is None:  # unexpected: load_strict names it
            out[key] = _whole(ref)
            continue
        layer = key.split(".")[-2] if "." in key else ""
        if key.endswith("experts.gate_up_proj"):  # [experts, hidden, 2 x width]: gate, then up
            out[key] = _expert_columns(_whole(ref), want[-1] // 2, tp)
        elif key.endswith("experts.down_proj"):  # [experts, width, hidden]
            out[key] = _range(ref, 1, tp.rank * want[1], want[1])
        elif layer in SEGMENTED:
            widths = lm.get_submodule(key.rsplit(".", 2)[0]).widths  # this rank's q, k, v channels
            starts = [0, *itertools.accumulate(widths)][:-1]  # of each part in the shard
            parts = [
                _range(ref, 0, s * tp.world + tp.rank * w, w) for s, w in zip(starts, widths, strict=True)
            ]
            out[key] = torch.cat(parts)
        elif key.rsplit(".", 1)[-1] in PER_HEAD:
            out[key] = _range(ref, 0, tp.rank * want[0], want[0])
        elif key in VOCAB:
            out[key] = _vocab_rows(ref, want, tp)
        elif layer in COLUMN:
            out[key] = _range(ref, 0, tp.rank * want[0], want[0])
        elif layer in ROW and key.endswith(".weight"):
            out[key] = _range(ref, 1, tp.rank * want[1], want[1])
        elif layer in ROW:  # bias
            out[key] = _whole(ref) if tp.rank == 0 else torch.zeros(want)
        else:
            out[key] = _whole(ref)
    return out


def _expert_columns(whole: torch.Tensor, width: int, tp: TPGroup) -> torch.Tensor:
    """This rank's columns of every expert's gate and of its up, side by side again."""
    half = whole.shape[-1] // 2
    lo = tp.rank * width
    return torch.cat([whole[..., lo : lo + width], whole[..., half + lo : half + lo + width]], dim=-1)


def _whole(ref) -> torch.Tensor:
    return ref.load() if hasattr(ref, "load") else ref


def _range(ref, dim: int, start: int, n: int) -> torch.Tensor:
    if hasattr(ref, "load_range"):
        return ref.load_range(dim, start, start + n)
    return ref.narrow(dim, start, n)


def _vocab_rows(ref, want: tuple[int, ...], tp: TPGroup) -> torch.Tensor:
    """This rank's vocabulary rows, padded with zero rows to the even share."""
    vocab = ref.shape[0]
    start, end = tp.shard(vocab)
    rows = _range(ref, 0, start, end - start) if end > start else None
    out = torch.zeros(want, dtype=rows.dtype if rows is not None else torch.float32)
    if rows is not None:
        out[: end - start] = rows
    return out
