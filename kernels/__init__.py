"""Attention backends: Triton paged attention (GPU), a torch path (the reference) and the CPU path
(torch plus C kernels: decode and prefill attention in cpu_decode.c and cpu_prefill.c, the fused
elementwise passes of cpu_elementwise.c, the language model's GEMM in cpu_gemm.c and the K/V write
in cpu_kv_write.c, built by cpu_build.py)."""
