"""Attention backends: Triton paged attention (GPU), a torch path (the reference) and the CPU path
(torch plus the C decode kernel in cpu_decode.c)."""
