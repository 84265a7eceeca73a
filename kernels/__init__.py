"""Attention backends: Triton paged attention (GPU) and a torch path (CPU, reference)."""
