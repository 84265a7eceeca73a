"""Which part of each language-model weight a tensor-parallel rank holds (Megatron's split):
q, k, v, gate and up by output rows (heads, columns), o_proj and down by input columns, the
embedding and the LM head by vocabulary rows; norms whole. Experts (MoE) split the same way
inside each expert; the router is whole. A linear-attention layer (Qwen3.5) splits by its key
and value heads: in_proj_qkv and the conv hold q, k and v channels one after the other, so each
of the three parts is split; z, beta, the decay's parameters by value heads; out_proj by rows.
A row-parallel layer's bias is added once, after the sum over ranks: rank 0 holds it, the others
zeros. `split_of` says where a tensor splits; the float weights (here) and the weights stored
quantized (parallel/shard_stored.py) are both cut by it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from mm_engine.parallel.group import TPGroup

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "in_proj_z", "in_proj_b", "in_proj_a")
ROW = ("o_proj", "down_proj", "out_proj")  # split the input (dim 1)
SEGMENTED = ("in_proj_qkv", "conv1d")  # q | k | v channels, each part split (dim 0)
PER_HEAD = ("dt_bias", "A_log")  # a linear-attention layer's per-value-head parameters
VOCAB = ("embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True, slots=True)
class Split:
    """A rank's share of a tensor: the `pieces` (start, length) along `dim` (0: output rows, 1:
    input columns) side by side, then zero rows up to `rows` (a vocabulary's even share)."""

    dim: int
    pieces: tuple[tuple[int, int], ...]
    rows: int | None = None


def split_of(key: str, want: tuple[int, ...], lm: nn.Module, tp: TPGroup, vocab: int = 0) -> Split | None:
    """How `key` (a weight or parameter of `lm`, built with `tp`, whose shard is `want` in shape;
    `vocab`: the stored tensor's rows, read for the embedding and head) splits; None: every rank
    holds it whole. Experts and row-parallel biases are shard_state's own."""
    layer = key.split(".")[-2] if "." in key else ""
    if layer in SEGMENTED:
        widths = lm.get_submodule(key.rsplit(".", 2)[0]).widths  # this rank's q, k, v channels
        starts = [0, *itertools.accumulate(widths)][:-1]  # of each part in the shard
        return Split(0, tuple((s * tp.world + tp.rank * w, w) for s, w in zip(starts, widths, strict=True)))
    if key.rsplit(".", 1)[-1] in PER_HEAD or (layer in COLUMN and key not in VOCAB):
        return Split(0, ((tp.rank * want[0], want[0]),))
    if key in VOCAB:
        start, end = tp.shard(vocab)
        return Split(0, ((start, end - start),), want[0])
    if layer in ROW and key.endswith(".weight"):
        return Split(1, ((tp.rank * want[1], want[1]),))
    return None


def shard_state(state: dict, lm: nn.Module, tp: TPGroup) -> dict[str, torch.Tensor]:
    """This rank's tensors for `lm` (built with `tp`), reading only its shard of each reference."""
    shapes = {k: tuple(v.shape) for k, v in lm.state_dict().items()}
    out = {}
    for key, ref in state.items():
        want = shapes.get(key)
        layer = key.split(".")[-2] if "." in key else ""
        if want is None:  # unexpected: load_strict names it
            out[key] = _whole(ref)
        elif key.endswith("experts.gate_up_proj"):  # [experts, hidden, 2 x width]: gate, then up
            out[key] = _expert_columns(_whole(ref), want[-1] // 2, tp)
        elif key.endswith("experts.down_proj"):  # [experts, width, hidden]
            out[key] = _range(ref, 1, tp.rank * want[1], want[1])
        elif layer in ROW and not key.endswith(".weight"):  # bias
            out[key] = _whole(ref) if tp.rank == 0 else torch.zeros(want)
        else:
            split = split_of(key, want, lm, tp, ref.shape[0] if key in VOCAB else 0)
            out[key] = _whole(ref) if split is None else _cut(ref, split, want)
    return out


def _cut(ref, split: Split, want: tuple[int, ...]) -> torch.Tensor:
    parts = [_range(ref, split.dim, start, n) for start, n in split.pieces if n > 0]
    got = torch.cat(parts, dim=split.dim) if parts else None
    if split.rows is None:
        return got
    out = torch.zeros(want, dtype=got.dtype if got is not None else torch.float32)
    if got is not None:
        out[: got.shape[0]] = got
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
