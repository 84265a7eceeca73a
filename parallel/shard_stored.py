"""Tensor-parallel shards of the weights a checkpoint stores quantized (models/checkpoint_quant.py):
each rank keeps its rows or input columns of the stored values, scales and zero points, cut where
parallel/shard.py cuts the float weights, so that nothing is rounded again and the ranks together
compute what one process would. A row-parallel shard keeps each input's own group scale (its
groups may be narrower than the stored ones, never mixed); inputs stored in act-order (GPTQ
`desc_act`) cannot be split by input, and are refused naming the layer."""

from __future__ import annotations

from torch import nn

from mm_engine.models.layers.quant_linear import QuantizedWeight, concat_weights
from mm_engine.parallel.group import TPGroup
from mm_engine.parallel.shard import VOCAB, split_of


def shard_stored(
    stored: dict[str, QuantizedWeight], lm: nn.Module, tp: TPGroup
) -> dict[str, QuantizedWeight]:
    """This rank's part of each stored weight (keyed by module path) for `lm`, built with `tp`."""
    shapes = {k: tuple(v.shape) for k, v in lm.state_dict().items()}
    out = {}
    for path, weight in stored.items():
        key = f"{path}.weight"
        want = shapes.get(key)
        if want is None:  # MoE experts: they run from the float state, which shard_state splits
            out[path] = weight
            continue
        split = split_of(key, want, lm, tp, weight.q.shape[0] if key in VOCAB else 0)
        try:
            out[path] = weight if split is None else _cut(weight, split.dim, split.pieces, split.rows)
        except ValueError as e:
            raise ValueError(f"{path} cannot be split over tensor_parallel_size {tp.world}: {e}") from None
        if tuple(out[path].q.shape) != want:
            raise ValueError(f"{path}: its stored weight's share {tuple(out[path].q.shape)} is not {want}")
    return out


def _cut(weight: QuantizedWeight, dim: int, pieces, rows: int | None) -> QuantizedWeight:
    parts = [weight.rows(s, s + n) if dim == 0 else weight.columns(s, s + n) for s, n in pieces]
    part = parts[0] if len(parts) == 1 else concat_weights(parts)
    return part if rows is None else part.padded_rows(rows)
