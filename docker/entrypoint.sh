#!/usr/bin/env bash
# The container's entrypoint: pick the allocator, bind to a NUMA node if asked, then run mm-engine.
#
#   (no arguments)          mm-engine serve on 0.0.0.0:8000 (the embedded demo model)
#   --flag ... | serve ...  mm-engine serve --host 0.0.0.0 --port 8000 ... (a --host or --port
#                           given wins: the last one counts; MM_ENGINE_HOST/PORT change the default)
#   caption|generate|env ...  that mm-engine command
#   anything else           run as given (a shell, python ...), under the same settings
#
# MM_ENGINE_ALLOCATOR: glibc (the default: with the engine's own mallopt tuning it was 11% faster
#   than jemalloc on a caption job, bench/results/allocators.json) or jemalloc, which comes in
#   through LD_PRELOAD with MALLOC_CONF (unless one is set already) at the settings PyTorch's CPU
#   tuning guide gives for inference (freed memory kept, big allocations apart, a background
#   thread purging); it held 8% less memory there.
# MM_ENGINE_NUMA_NODE: a node number: the process's CPUs and memory on that node (numactl).
set -euo pipefail

JEMALLOC_CONF_DEFAULT="oversize_threshold:1,background_thread:true,metadata_thp:auto,dirty_decay_ms:9000000000,muzzy_decay_ms:9000000000"

find_jemalloc() {
    local lib
    for lib in /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 /usr/lib/aarch64-linux-gnu/libjemalloc.so.2 \
        /usr/lib/libjemalloc.so.2 /usr/local/lib/libjemalloc.so.2; do
        [ -e "$lib" ] && { echo "$lib"; return 0; }
    done
    return 1
}

allocator=${MM_ENGINE_ALLOCATOR:-glibc}
case "$allocator" in
    jemalloc)
        lib=$(find_jemalloc) || {
            echo "entrypoint: MM_ENGINE_ALLOCATOR=jemalloc but no libjemalloc.so.2 is installed" >&2
            exit 2
        }
        export LD_PRELOAD="$lib${LD_PRELOAD:+:$LD_PRELOAD}"
        export MALLOC_CONF="${MALLOC_CONF:-$JEMALLOC_CONF_DEFAULT}"
        ;;
    glibc) ;;
    *)
        echo "entrypoint: MM_ENGINE_ALLOCATOR must be glibc or jemalloc, got '$allocator'" >&2
        exit 2
        ;;
esac

prefix=()
if [ -n "${MM_ENGINE_NUMA_NODE:-}" ]; then
    if ! [[ "$MM_ENGINE_NUMA_NODE" =~ ^[0-9]+$ ]]; then
        echo "entrypoint: MM_ENGINE_NUMA_NODE must be a node number, got '$MM_ENGINE_NUMA_NODE'" >&2
        exit 2
    fi
    command -v numactl >/dev/null || { echo "entrypoint: MM_ENGINE_NUMA_NODE needs numactl" >&2; exit 2; }
    prefix=(numactl "--cpunodebind=$MM_ENGINE_NUMA_NODE" "--membind=$MM_ENGINE_NUMA_NODE")
fi

if [ $# -gt 0 ] && [ "$1" = serve ]; then
    shift
    set -- -- "$@"
fi
if [ $# -eq 0 ] || [[ "$1" == -* ]]; then
    [ "${1:-}" = -- ] && shift
    set -- mm-engine serve --host "${MM_ENGINE_HOST:-0.0.0.0}" --port "${MM_ENGINE_PORT:-8000}" "$@"
elif [[ "$1" =~ ^(caption|generate|env)$ ]]; then
    set -- mm-engine "$@"
fi
exec ${prefix[@]+"${prefix[@]}"} "$@"
