"""Multimodal rotary positions (M-RoPE) of the Qwen VL line, computed once per request.

Text tokens advance all three axes (temporal, height, width) together. An image's tokens, on its
merged grid `t x h x w`, sit at `start + (ti, hi, wi)`; a video's temporal index is scaled by its
`temporal_step` first (Qwen2.5-VL: `floor(ti x tokens_per_second x seconds per patch)`). The text
after either continues from `start + max(h, w)`, as transformers places it. A clip encoded in
groups of temporal patches (several spans, `time_offset` > 0 after the first) is one grid. Any
later token `i` (decode, or output recomputed after preemption) is at `i + delta` on every axis,
where `delta` is the prompt's last position + 1 minus its length.
"""

from __future__ import annotations

import torch

from mm_engine.models.interface import Positions
from mm_engine.request import ImageSpan


def mrope_positions(num_tokens: int, images: list[ImageSpan], merge: int) -> Positions:
    pieces: list[torch.Tensor] = []
    pos = done = 0  # next position, and prompt tokens placed so far
    start = 0  # where the current image or clip's grid starts
    for k, span in enumerate(images):
        text = span.offset - done
        pieces.append(torch.arange(pos, pos + text).expand(3, -1))
        pos += text
        if span.time_offset == 0 or text:  # a new image or clip (a clip's later group continues it)
            start = pos
        t, h, w = span.grid[0], span.grid[1] // merge, span.grid[2] // merge
        # A video's patches spaced in time, in float32 as transformers computes them.
        patches = torch.arange(span.time_offset, span.time_offset + t)
        times = (patches * torch.tensor(span.temporal_step, dtype=torch.float32)).long()
        grid = torch.stack(torch.meshgrid(times, torch.arange(h), torch.arange(w), indexing="ij"))
        grid = grid.reshape(3, -1) + start
        if grid.shape[1] != span.length:
            raise ValueError(f"an image grid of {grid.shape[1]} tokens does not match its {span.length}")
        pieces.append(grid)
        done = span.offset + span.length
        following = images[k + 1] if k + 1 < len(images) else None
        if following is None or following.time_offset == 0 or following.offset != done:
            pos = start + max(h, w)  # the clip (or image) ends here
    pieces.append(torch.arange(pos, pos + num_tokens - done).expand(3, -1))
    prompt = torch.cat(pieces, dim=1).contiguous()
    # Later tokens continue from the prompt's last position (transformers' generate adds one to it),
    # which a video's time positions may exceed; for images it is the largest position.
    return Positions(prompt, int(prompt[:, -1].max()) + 1 - num_tokens)
