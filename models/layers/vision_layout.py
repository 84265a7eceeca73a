"""Where each patch of a step's images sits for a Qwen-style tower: the attention segments (one per
image frame, and Qwen2.5's windows), the order the blocks see the patches in, and each patch's
(row, column) for the 2-D rotary embedding. Host work, once per encode call, cached per grid.

The processor hands an image's patches merge unit by merge unit (the `merge x merge` patches that
become one language-model token are adjacent). Qwen2.5-VL's windowed layers attend within squares
of `window x window` merge units: the tower reorders the units window by window (each window's
units row by row, windows row by row, frames first), so that every window is one contiguous
segment, runs all its blocks in that order (a full-attention layer sees whole frames, which stay
contiguous) and puts the merged tokens back in image order at the end.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from mm_engine.kernels.metadata import Segments


@dataclass(frozen=True, slots=True)
class TowerLayout:
    frames: Segments  # one segment per image frame (the full-attention layers)
    windows: Segments | None  # one per window (None: the tower has no windowed layers)
    order: torch.Tensor | None  # patch rows in the order the blocks see them (None: as given)
    restore: torch.Tensor | None  # merged rows back in image order (None: already)
    positions: torch.Tensor  # [patches, 2] each patch's (row, column), in block order


def tower_layout(grids: list[tuple[int, int, int]], merge: int, window: int | None = None) -> TowerLayout:
    """`grids`: each image's (frames, patch rows, patch columns); `window`: merge units per window
    side, or None for a tower without windows."""
    unit = merge * merge
    frames, windows, orders, positions = [], [], [], []
    units_before = 0
    for t, h, w in grids:
        if h % merge or w % merge:
            raise ValueError(f"a patch grid of {h} x {w} does not divide into {merge} x {merge} merge units")
        frames += [h * w] * t
        local = _grid(t, h, w, merge, window)
        positions.append(local.positions)
        if window is not None:
            windows += [n * unit for n in local.window_units]
            orders.append(local.unit_order + units_before)
        units_before += t * (h // merge) * (w // merge)
    order = restore = None
    if window is not None:
        units = torch.cat(orders)
        order = (units[:, None] * unit + torch.arange(unit)).flatten()
        restore = torch.argsort(units)
    pos = torch.cat(positions)
    return TowerLayout(
        Segments.of(frames),
        Segments.of(windows, windows=True) if window is not None else None,
        order,
        restore,
        pos if order is None else pos[order],
    )


@dataclass(frozen=True, slots=True)
class _GridLayout:
    positions: torch.Tensor  # [t * h * w, 2], processor order
    unit_order: torch.Tensor | None  # merge units in window order
    window_units: tuple[int, ...]  # merge units per window, in window order


@functools.lru_cache(maxsize=512)
def _grid(t: int, h: int, w: int, merge: int, window: int | None) -> _GridLayout:
    gh, gw = h // merge, w // merge
    # Processor order: frame, unit row, unit column, row within the unit, column within it.
    rows = torch.arange(h).view(gh, merge, 1, 1).expand(gh, merge, gw, merge).permute(0, 2, 1, 3)
    cols = torch.arange(w).view(1, 1, gw, merge).expand(gh, merge, gw, merge).permute(0, 2, 1, 3)
    positions = torch.stack([rows.flatten(), cols.flatten()], dim=1).repeat(t, 1)
    if window is None:
        return _GridLayout(positions, None, ())
    wh, ww = -(-gh // window), -(-gw // window)
    f = torch.arange(t).view(t, 1, 1)
    r = torch.arange(gh).view(1, gh, 1)
    c = torch.arange(gw).view(1, 1, gw)
    win = ((f * wh + r // window) * ww + c // window).expand(t, gh, gw).flatten()
    within = ((r % window) * window + c % window).expand(t, gh, gw).flatten()
    unit_order = torch.argsort(win * window * window + within)
    counts = torch.bincount(win, minlength=t * wh * ww)
    return _GridLayout(positions, unit_order, tuple(int(n) for n in counts))


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[patches, 1, head_dim // 2]` of the axial 2-D rotary (a quarter of a head turns
    with the row, a quarter with the column, each half of the head as in rotate_half), float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float) / (head_dim // 2)))
    angles = (positions[:, :, None].float() * inv_freq).flatten(1)  # [patches, row angles | column angles]
    return angles.cos()[:, None, :], angles.sin()[:, None, :]
