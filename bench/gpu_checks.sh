#!/usr/bin/env bash
# Everything this project checks and measures on a CUDA GPU, in one run (a lent GPU's time is
# short): the Triton kernels and the engine against their references, the low-bit GEMMs, serving
# under load, then bench.offline and the rest on the GPU. Run from the repository root:
#
#     OUT=/some/dir bash bench/gpu_checks.sh
#
# It needs torch, triton, torchvision and pillow there; the other packages pyproject names (and
# transformers at this project's version) travel as wheels in .whl/ (docs/testing.md says how to
# download them) and are installed into /tmp/site first. It links the package layout the editable
# install would make. Each step has its own time limit and a failing step does not stop the next;
# logs and JSON land in $OUT. The steps run in the order of what is owed most; BUDGET (seconds,
# default 540) caps the whole run: a step gets at most what is left of it, and those left over
# are skipped. PACK=FILE keeps an archive of $OUT up to date after every step.
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
    # PACK=FILE: everything so far in one archive after each step (a lent machine returns few files)
    [ -n "${PACK:-}" ] && tar czf "$PACK" -C "$OUT" .
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >"$OUT/wheels.log" 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    echo "== wheels: $(ls .whl | wc -l) installed in $SECONDS s"
fi
$PY -c "import torch, triton, transformers, litestar, xgrammar, zmq; print('torch', torch.__version__, 'triton',
      triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"

# 1. Correctness: the Triton kernel tests (attention, varlen, hybrid and MoE, low-bit GEMM, FP8
#    scaled_mm), bench.kernels' own test and the engine on the Triton backend, all compiled on the
#    GPU (MM_ENGINE_TEST_DEVICE), against float64 / CPU references.
TAIL=12 step tests 150 env MM_ENGINE_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider \
    tests/kernels/test_triton_kernels.py tests/kernels/test_bench_kernels.py tests/kernels/test_triton_engine.py \
    tests/kernels/test_triton_hybrid_moe.py tests/kernels/test_triton_qgemm.py tests/kernels/test_fp8_mm.py

# 1b. Every model family on the Triton backend compiled on the GPU (the towers through the varlen
#     kernel), and the quantized checkpoints on it, against transformers' tokens.
TAIL=8 step families 120 env MM_ENGINE_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider \
    tests/families/test_qwen_vl.py tests/families/test_tiled_vl.py tests/families/test_anyres_vl.py \
    tests/families/test_gemma3.py tests/families/test_video.py tests/engine/test_quantization.py \
    tests/families/test_gemma4.py tests/families/test_glm.py tests/families/test_paddleocr.py \
    tests/families/test_video_smolvlm.py -k "triton"

# 2. The low-bit GEMMs against float16 at a 7B model's widths.
TAIL=40 step qgemm 75 $PY -m bench.qgemm_gpu --json "$OUT/qgemm_gpu.json"

# 3. Decodes under image load (#32): the idle ITL, then 64 streams of the same kind of trace, on the
#    GPU (the server picks device auto: CUDA, float16).
TAIL=14 step serve_idle 80 $PY -m bench.serve --num-prompts 8 --request-rate inf --max-concurrency 1 \
    --json "$OUT/serve_idle_gpu.json"
TAIL=30 step serve_64 130 $PY -m bench.serve --num-prompts 160 --request-rate inf --max-concurrency 64 \
    --json "$OUT/serve_64_gpu.json"

# 4. Offline throughput against transformers, both on the GPU in float16 (the towers are the
#    engine's now). transformers' batch size is fixed: its sweep took longer than a loan allows.
GPU_ARGS=(--device cuda --max-num-batched-tokens 8192 --max-num-seqs 256)
TAIL=16 step caption 150 $PY -m bench.offline --workload caption --num-images 256 --hf-batch-size 128 \
    "${GPU_ARGS[@]}" --json "$OUT/offline_caption_gpu.json"

# 5. What earlier loans measured, when time is left: the README's first command, host overhead,
#    async scheduling and structured output on CUDA, paged attention against SDPA, chat offline.
TAIL=4 step generate 60 $PY -m mm_engine.cli generate --image examples/scene.png --prompt "Describe the image."
# (MM_ENGINE_TEST_DEVICE=cuda only turns the Triton interpreter off: these engines pick CUDA.)
TAIL=6 step async 120 env MM_ENGINE_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider tests/engine/test_async_scheduling.py \
    tests/engine/test_structured_output.py tests/engine/test_parallel_sampling.py tests/engine/test_logit_adjust.py -k "not mrope"
TAIL=12 step host_overhead 90 $PY -m bench.host_overhead --device cuda --json "$OUT/host_overhead_gpu.json"
TAIL=6 step structured 60 $PY -m bench.structured_output --device cuda --requests 64 \
    --json "$OUT/structured_output_gpu.json"
TAIL=30 step kernels 150 $PY -m bench.kernels --out "$OUT/kernels.json"
TAIL=16 step chat 180 $PY -m bench.offline --workload chat --num-images 16 --hf-batch-size 64 \
    "${GPU_ARGS[@]}" --json "$OUT/offline_chat_gpu.json"
