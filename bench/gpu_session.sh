#!/usr/bin/env bash
# One GPU session's measurements in two calls of at most 10 minutes each (device time is
# 30 minutes a session; a cold machine takes 1-2 of them). From the project root, after
# `bash ../shared/gpu/prepare-mlx-cuda` and `pip download mlx-lm==0.32.2 --no-deps -d .whl`
# here, and the shared configs copied to .gpu/shared-data/configs:
#   call 1 (carry .mlx-cuda-a):                 bash .mlx-cuda-a/stage.sh
#   call 2 (carry .mlx-cuda-b .whl .gpu), <30 s: bash bench/gpu_session.sh demo
#   call 3 (same carry), <30 s after call 2:    bash bench/gpu_session.sh bench [NAMES]
#   or: bash bench/gpu_session.sh graphs   (the demo's round under CUDA graph settings)
# A `bench` call of qwen3_5 and gemma4 with the probes takes ~9 minutes; within the 10-minute
# limit per call, split it: `bench qwen3_5`, then `PROBES=0 bash bench/gpu_session.sh bench
# gemma4`.
# `demo` builds the demo pair (--preset gpu) into /tmp/demo and leaves it as $OUT/demo.tgz.*
# (15 MB parts: cat them and untar over plugins/demo/mlxrunner_demo/model to ship it);
# `bench` runs the CUDA-only tests, then every benchmark into $OUT (JSON), and measures the
# shipped demo pair and, if call 2 ran on this machine, the new one. At most 8 files come
# back from $OUT, so `bench` leaves its JSON and logs in one $OUT/results.tgz.
# MLX compiles its CUDA kernels on first use (30-100 s on a fresh machine, 95 s for the
# draft trainer's step). Both modes keep them in .gpu/ptx-cache (MLX_PTX_CACHE_DIR) and
# return it as $OUT/ptx-cache.txz.* (xz: a third of gzip's bytes, so that it travels beside a
# 40 MB file): cat those into .gpu/ptx-cache.txz here, and the next
# machine starts with the kernels compiled.
set -u
source .mlx-cuda-b/env.sh >/dev/null && source bench/gpu_setup.sh >/dev/null 2>&1
export PYTHONUNBUFFERED=1 MLXRUNNER_SHARED_DATA=$PWD/.gpu/shared-data
export MLX_PTX_CACHE_DIR=$PWD/.gpu/ptx-cache
mkdir -p "$MLX_PTX_CACHE_DIR"
# a previous session's kernels, carried as one archive (fewer bytes than the folder)
bash bench/ptx_cache.sh restore "$MLX_PTX_CACHE_DIR"
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
# the compiled kernels go back whatever happens below (the sources MLX writes beside them
# are not needed to reuse them)
trap 'bash bench/ptx_cache.sh save "$MLX_PTX_CACHE_DIR" "$out"' EXIT
case "${1:-}" in
  demo)
    timeout 560 python3 plugins/demo/recipe/build_demo.py --out /tmp/demo \
      --time-budget-s "${DEMO_BUDGET_S:-440}" > "$out/build.txt" 2>&1
    echo "build exit $?"
    grep -v "^step \|target step" "$out/build.txt" | tail -14
    cp /tmp/demo.build/build_summary.json /tmp/demo.build/model_card_figures.md "$out/" 2>/dev/null
    (cd /tmp && tar czf demo.tgz demo && split -b 15m demo.tgz "$out/demo.tgz.")
    ;;
  bench)
    # names: topk qwen3_5 gemma4 speculative (default: all; about 2-3 minutes each on the
    # H200, so split them over two calls when the demo build does not run)
    # (PROBES=0: skip the CUDA tests and the two probes below, e.g. in a second call)
    shift
    if [ "${TESTS:-1}" = 1 ]; then
      # first the tests that need CUDA (skipped on CI): the fused kernels against MLX
      echo "== CUDA tests"
      timeout "${CUDA_TESTS_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider \
        tests/core/test_topk.py tests/core/test_attention.py tests/core/test_kernels.py \
        tests/core/test_compiled_step.py 2>&1 |
        tee "$out/cuda-tests.txt" | tail -4
    fi
    if [ "${PROBES:-1}" = 1 ]; then
      echo "== attention paths"
      timeout 60 python3 bench/sdpa_paths.py 2>&1 | tee "$out/sdpa_paths-gpu.txt" | tail -12
      echo "== projection times"
      timeout 60 python3 bench/projection_times.py --json "$out/projections-gpu.json" 2>&1 |
        tail -9
      echo "== op costs"
      timeout 60 python3 bench/op_costs.py --json "$out/op_costs-gpu.json" 2>&1 |
        tee "$out/op_costs-gpu.txt" | tail -16
    fi
    for name in "${@:-topk qwen3_5 gemma4 speculative}"; do
      for one in $name; do
        label=$one  # the file names (a case below may change $one)
        echo "== $one"
        # second instances with one thing off each: what it saves, in the same run
        case $one in
          qwen3_5) extra="--switched attention=folded --switched kernels=attention" ;;
          gemma4) extra="--switched attention=folded --no-eager" ;;
          none) continue ;;  # (a call of the probes, start-up or parity only)
          llama) extra="" ;;
          llama-narrow) one=llama; extra="--narrow --no-plain" ;;
          qwen3_5-8k) one=qwen3_5; extra="--prompt 8192 --new 64 --repeats 2 --prefill-chunk 2048 --verify-block 0" ;;
          qwen3_5-32k) one=qwen3_5; extra="--prompt 32768 --new 32 --repeats 1 --prefill-chunk 2048 --verify-block 0" ;;
          # Qwen3.5-35B-A3B's shape, 4-bit (random weights, ~18 GiB), against mlx-lm
          qwen3_5-moe) one=qwen3_5_moe; extra="--bits 4" ;;
          # MTP round costs per depth: the 0.8B shape, and the 35B-A3B shape in 4-bit
          mtp) extra="--context 1024" ;;
          mtp-moe) one=mtp; extra="--moe --context 1024" ;;
          # which part of a short verify forward costs what (kernels, attention, products)
          verify_paths-diag) one=verify_paths; extra="--lengths 1 2 3 4 --repeats 12 -v
            --switched kernels=attention,topk --switched kernels=deltanet,topk
            --switched attention=mlx --switched row_products=0" ;;
          verify_paths-rows) one=verify_paths; extra="--lengths 1 2 4 8 16 --repeats 12 --switched row_products=0" ;;
          # the demo pair's streams with their drafts in the batch against without
          batch-pair) one=batch; extra="--pair demo-qwen3.5 --streams 1 4 16 32 --repeats 2" ;;
          batch_step-kinds) one=batch_step; extra="--kinds --streams 1 8 16 32" ;;
          # a 4k-token conversation's second turn with the prefix cache (issue 20's goal)
          prefix_cache-4k) one=prefix_cache
            extra="--random-config $MLXRUNNER_SHARED_DATA/configs/Qwen3.5-0.8B-Base.config.json --tokens 4096 --rounds 3" ;;
          *) extra="" ;;
        esac
        # shellcheck disable=SC2086
        timeout "${BENCH_TIMEOUT:-200}" python3 "bench/$one.py" $extra --json "$out/$label-gpu.json" \
          2>&1 | tee "$out/$label-gpu.txt" | grep -v "^\s*$" | tail -"${TAIL_LINES:-12}"
      done
    done
    if [ "${DEMO:-1}" = 1 ]; then
    timeout 90 mlxrunner bench default --prompt "def fibonacci(n):" --max-tokens 128 \
      --repeats 3 --warmup 2 --json "$out/demo-gpu.json"
    # where the demo pair's round goes: draft, verify and round time per depth
    timeout 90 python3 bench/speculative.py --model default --json \
      "$out/speculative-demo-gpu.json" | tail -"${TAIL_LINES:-12}"
    fi
    if [ "${STARTUP:-0}" = 1 ]; then
      echo "== start-up"
      timeout 240 python3 bench/startup.py --profile 30 --json "$out/startup-gpu.json" 2>&1 | tail -60
    fi
    if [ "${PARITY:-0}" = 1 ]; then
      echo "== float32 GPU vs CPU"
      timeout "${PARITY_TIMEOUT:-240}" python3 bench/gpu_cpu_parity.py ${PARITY_NAMES:+--names $PARITY_NAMES} \
        --json "$out/parity-gpu.json" 2>&1 |
        tee "$out/parity-gpu.txt" | tail -20
    fi
    if [ -d /tmp/demo/draft ]; then
      timeout 90 mlxrunner bench /tmp/demo --prompt "def fibonacci(n):" --max-tokens 128 \
        --repeats 3 --warmup 2 --json "$out/demo-built-gpu.json"
    fi
    (cd "$out" && tar czf results.tgz --remove-files -- *.json *.txt 2>/dev/null)
    ;;
  graphs)
    # the demo pair's round under MLX's CUDA graph settings, one process each (MLX reads them
    # once). Session 6: a larger graph cache changed nothing; without graphs a verify block
    # is cheaper but plain decoding no faster (bench/results/2026-12-01d-h200/README.md)
    for setting in "" MLX_CUDA_GRAPH_CACHE_SIZE=2000 MLX_USE_CUDA_GRAPHS=0; do
      echo "== [${setting:-defaults}]"
      env $setting timeout 90 mlxrunner bench default --prompt "def fibonacci(n):" \
        --max-tokens 128 --repeats 3 --warmup 2 --json "$out/demo-${setting:-defaults}.json" |
        tail -2
      env $setting timeout 90 python3 bench/speculative.py --model default --json \
        "$out/speculative-demo-${setting:-defaults}.json" | tail -9
    done
    (cd "$out" && tar czf results.tgz --remove-files -- *.json 2>/dev/null)
    ;;
  *) echo "usage: bash bench/gpu_session.sh demo | bench [topk qwen3_5 gemma4 speculative]" \
       "| graphs" >&2
     exit 2 ;;
esac
