"""Attention backends: Triton paged attention (GPU), a torch path (the reference) and the CPU path
(torch plus C kernels: decode and prefill attention in cpu_decode.c and cpu_prefill.c, and the
fused elementwise passes of cpu_elementwise.c, built by cpu_build.py)."""
