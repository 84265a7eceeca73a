#!/usr/bin/env bash
# Everything this project checks and measures on a CUDA GPU, in one run (a lent GPU's time is
# short): the Triton kernels and the engine against their references, then bench.kernels, then
# bench.offline on the GPU. Run from the repository root:
#
#     OUT=/some/dir bash bench/gpu_checks.sh
#
# It needs torch, triton, transformers, tokenizers, torchvision and pillow (no pip install: it
# links the package layout the editable install would make). Each step has its own time limit and
# a failing step does not stop the next; logs and JSON land in $OUT. BUDGET (seconds, default 540)
# caps the whole run: a step gets at most what is left of it.
set -u
OUT=${OUT:-/tmp/gpu_checks}
BUDGET=${BUDGET:-540}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}

# The layout `pip install -e .` maps (pyproject's package-dir): mm_engine.kernels -> kernels/ ...
for d in vision kernels pools sched api models core parallel; do
    [ -e "mm_engine/$d" ] || ln -s "../$d" "mm_engine/$d"
done

step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, report the status
    local name=$1 limit=$2 left=$((BUDGET - SECONDS))
    shift 2
    if ((left < 30)); then
        echo "== $name: skipped, $left s of the budget left"
        return
    fi
    ((limit > left)) && limit=$left
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s"
    tail -n "${TAIL:-25}" "$OUT/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
      'transformers', transformers.__version__, torch.cuda.get_device_name())"

# 1. Correctness: the Triton kernel tests, bench.kernels' own test and the engine on the Triton
#    backend, all compiled on the GPU (MM_ENGINE_TEST_DEVICE), against float64 / CPU references.
TAIL=12 step tests 150 env MM_ENGINE_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider \
    tests/kernels/test_triton_kernels.py tests/kernels/test_bench_kernels.py tests/kernels/test_triton_engine.py \
    tests/kernels/test_triton_hybrid_moe.py tests/kernels/test_triton_qgemm.py

# 1a. Async scheduling on CUDA (device auto: the engine on the GPU in float16): pinned copies,
#     queued launches and the event the tokens are read behind, against the plain loop.
TAIL=6 step async 120 $PY -m pytest -q -p no:cacheprovider tests/engine/test_async_scheduling.py \
    tests/engine/test_structured_output.py tests/engine/test_parallel_sampling.py tests/engine/test_logit_adjust.py -k "not mrope"

# 1a'. The tensor-parallel code path with one rank through NCCL (this machine has one GPU).
TAIL=6 step tensor_parallel 60 $PY -m pytest -q -p no:cacheprovider tests/system/test_tensor_parallel.py \
    -k "size_one"

# 1b. Every model family on the Triton backend compiled on the GPU, against transformers' tokens.
TAIL=8 step families 120 env MM_ENGINE_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider \
    tests/families/test_qwen_vl.py tests/families/test_tiled_vl.py tests/families/test_anyres_vl.py tests/families/test_gemma3.py -k "triton"

# 2. The README's first command on the GPU (demo model, float16).
TAIL=4 step generate 60 $PY -m mm_engine.cli generate --image examples/scene.png \
    --prompt "Describe the image."

# 2b. Host time of a decode step at batch 1-256 on the GPU (in-process and the core's share).
TAIL=12 step host_overhead 90 $PY -m bench.host_overhead --device cuda --json "$OUT/host_overhead_gpu.json"

# 2c. Async scheduling on and off on the GPU (engine only, the bench model, alternating).
TAIL=6 step async_bench 90 $PY -m bench.async_scheduling --device cuda --modes off,inline --num-images 64 \
    --json "$OUT/async_scheduling_gpu.json"

# 2d. Structured output's cost per token on the GPU (xgrammar's bitmask applied on the device).
TAIL=6 step structured 60 $PY -m bench.structured_output --device cuda --requests 64 \
    --json "$OUT/structured_output_gpu.json"

# 3. Paged attention against SDPA.
TAIL=30 step kernels 150 $PY -m bench.kernels --out "$OUT/kernels.json"

# 4. Offline throughput against transformers, both on the GPU in float16. transformers' batch sizes
#    are fixed: its sweep (bench.offline.HF_SWEEP_GPU) took longer than a 15-minute loan allows, and
#    on an H200 its throughput kept rising with the batch up to these sizes (README). Chat runs 16
#    images, since at 64 transformers alone takes about 4 minutes there.
GPU_ARGS=(--device cuda --max-num-batched-tokens 8192 --max-num-seqs 256)
TAIL=16 step caption 150 $PY -m bench.offline --workload caption --num-images 256 --hf-batch-size 128 \
    "${GPU_ARGS[@]}" --json "$OUT/offline_caption_gpu.json"
# 4b. The same without async scheduling: before/after of the overlap (the default on CUDA).
TAIL=16 step caption_sync 150 $PY -m bench.offline --workload caption --num-images 256 --hf-batch-size 128 \
    "${GPU_ARGS[@]}" --async-scheduling off --json "$OUT/offline_caption_gpu_sync.json"
TAIL=16 step chat 180 $PY -m bench.offline --workload chat --num-images 16 --hf-batch-size 64 \
    "${GPU_ARGS[@]}" --json "$OUT/offline_chat_gpu.json"
