"""Attention backends and the ops a model's layers call: Triton paged attention (GPU), a torch path
(the reference) and the CPU path (torch plus C kernels: decode and prefill attention in
cpu_decode.c and cpu_prefill.c, the fused elementwise passes of cpu_elementwise.c, the language
model's GEMM in cpu_gemm.c and the K/V write in cpu_kv_write.c, built per ISA variant by
cpu_build.py and chosen per kernel by cpu_kernels.py; ops.py is what the layers call).

Leaf math: nothing here imports the engine or the model.
"""
