"""Vision-encoder outputs cached by image content hash, bounded in bytes, least recently used out.

The key is the content hash of the decoded pixels plus the preprocessing settings, so the same
picture uploaded twice (in any file format that decodes to the same pixels) is encoded once.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def contains(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> torch.Tensor | None:
        feats = self._entries.get(key)
        if feats is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return feats

    def put(self, key: str, feats: torch.Tensor) -> None:
        size = feats.numel() * feats.element_size()
        if key in self._entries or size > self.capacity_bytes:
            return
        while self.used_bytes + size > self.capacity_bytes:
            _, old = self._entries.popitem(last=False)
            self.used_bytes -= old.numel() * old.element_size()
            self.evictions += 1
        self._entries[key] = feats
        self.used_bytes += size
