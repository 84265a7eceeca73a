"""Attention backends and the ops a model's layers call: Triton paged attention (GPU), a torch path
(the reference) and the CPU path (torch plus C kernels: decode and prefill attention in
cpu_decode.c and cpu_prefill.c, the fused elementwise passes of cpu_elementwise.c, the language
model's GEMM in cpu_gemm.c and the K/V write in cpu_kv_write.c, built per ISA variant by
cpu_build.py and chosen per kernel by cpu_kernels.py; ops.py is what the layers call).

Leaf math: nothing here imports the engine or the model.
"""

import sys as _sys

if __name__ == "kernels":
    # Imported under its folder's bare name: the checkout's root is on sys.path (`python -m` run
    # there) and this folder shadows the `kernels` distribution that transformers imports. Load that
    # distribution in this module's place; the engine's own kernels are `mm_engine.kernels`.
    import importlib.machinery as _machinery
    import importlib.util as _util
    from pathlib import Path as _Path

    _root = _Path(__file__).resolve().parent.parent
    _elsewhere = [p for p in _sys.path if _Path(p or ".").resolve() != _root]
    _spec = _machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is None:
        raise ImportError(
            f"no `kernels` distribution outside {_root}: the folder of that name there is mm-engine's "
            "own (import it as `mm_engine.kernels`)"
        )
    _module = _util.module_from_spec(_spec)
    _sys.modules["kernels"] = _module  # the import statement returns what sys.modules holds
    _spec.loader.exec_module(_module)
