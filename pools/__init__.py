"""KV cache memory: the per-layer K/V tensors and the two block pools (text, image)."""
