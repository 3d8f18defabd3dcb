#!/usr/bin/env bash
# Issue 36's GPU figures in one call of at most 10 minutes, after `bash .mlx-cuda-a/stage.sh`
# (see ../shared/gpu/prepare-mlx-cuda; carry .mlx-cuda-b .whl .gpu, the shared configs copied
# to .gpu/shared-data/configs):
#   bash bench/gpu_contract.sh [tests] [qwen3] [llama] [gemma4] [qwen3_5] [startup] [solo]
#     [pair] [soak] [vision] [launch] [prefill] [products] [attention] [sweep]
#     (SWITCHED="NAME=VALUE ...": a row of ours under each; BENCH_ARGS: more arguments of
#     the model benches, e.g. --no-eager)
#   (default: the first four)
# tests: the compiled-step and kernel tests on the GPU (TESTS: other test files); qwen3: a Qwen3 written as the docs
# teach against mlx-lm (bench/qwen3.py); llama: the example architecture and a plain mlx.nn
# Llama against mlx-lm (bench/llama.py); gemma4, qwen3_5: those benches; startup:
# bench/startup.py (a fresh kernel cache, then 3 warm processes); solo: the demo pair through
# generate alone (bench/draft_alone.py), this core and those copied to .gpu/other*/core,
# taking turns twice; pair: the demo pair's
# streams with drafts in the batch against without (bench/batch.py --pair, 1/4/16/32
# streams); soak: serve under 2,000 requests in bursts of 1-32, drafts on and off
# (bench/serve_soak.py --bursts; needs the server's wheels in .whl: fastapi, starlette,
# pydantic, pydantic-core, uvicorn, annotated-types, typing-inspection, opentelemetry-api,
# which the GPU machine lacks); vision: issue 39's time to first token for a 0.8B-shape
# Qwen3.5 with one 1024x1024 image against mlx-vlm (bench/vision_ttft.py; needs mlx-vlm's
# wheel in .whl, mlx_vlm-0.7.10-py3-none-any.whl, installed without its dependencies).
# launch: host time per kernel launch, built-in against custom kernels (bench/launch_cost.py).
# products: a Gemma 4 E2B decode step's products, ours against MLX's, per call and in GB/s,
# and one call's time on the device alone (bench/product_bandwidth.py); attention: a Gemma 4
# E2B decode step's attention, ours against the folded form and MLX's function, the same
# (bench/attention_device.py). The model benches
# print each row's device time a step beside build, submit and wait (bench/device_clock.py).
# prefill: a Gemma 4 prefill in parts, ours against mlx-lm's (bench/gemma4_prefill.py;
# PREFILL_ARGS=--profile: where our build's Python time goes; --series: each prompt in turn).
# sweep: our Gemma 4 decode step under MLX's graph settings, a process each
# (bench/mlx_env_sweep.py; SWEEP_ARGS: its arguments, e.g. "--bench qwen3_5").
# Results in $OUT/results.tgz.
set -u
source .mlx-cuda-b/env.sh >/dev/null && source bench/gpu_setup.sh >/dev/null 2>&1
export PYTHONUNBUFFERED=1 MLXRUNNER_SHARED_DATA=$PWD/.gpu/shared-data
export MLX_PTX_CACHE_DIR=/tmp/ptx-cache  # kept while the machine is
mkdir -p "$MLX_PTX_CACHE_DIR"
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
switched=()
for s in ${SWITCHED:-}; do switched+=(--switched "$s"); done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/machine.txt"
for part in "${@:-tests qwen3 llama startup}"; do
  for one in $part; do
    echo "== $one"
    case $one in
      tests)
        # shellcheck disable=SC2086  # (TESTS: test files, space-separated)
        timeout "${TESTS_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider \
          ${TESTS:-tests/core/test_fused_rows.py tests/core/test_fused_gated.py \
          tests/core/test_attention.py tests/core/test_kernels.py tests/core/test_nn_deltanet.py \
          tests/core/test_topk.py tests/core/test_compiled_step.py \
          tests/core/test_attention_styles.py tests/core/test_fused_products.py \
          tests/core/test_fused_norms.py tests/core/test_constants.py} 2>&1 \
          | tee "$out/cuda-tests.txt" | tail -4 ;;
      qwen3|llama|gemma4|qwen3_5)
        # shellcheck disable=SC2086  # (BENCH_ARGS: more arguments, e.g. --no-eager)
        (cd bench && timeout "${BENCH_TIMEOUT:-240}" python3 "$one.py" --repeats "${REPEATS:-5}" \
          "${switched[@]}" ${BENCH_ARGS:-} --json "$out/$one-gpu.json") 2>&1 \
          | tee "$out/$one-gpu.txt" | tail -16 ;;
      vision)
        (cd bench && timeout "${VISION_TIMEOUT:-300}" python3 vision_ttft.py \
          --repeats "${REPEATS:-5}" --json "$out/vision-gpu.json") 2>&1 \
          | tee "$out/vision-gpu.txt" | tail -8 ;;
      solo)  # generate alone with the demo pair's draft: this core and .gpu/other*'s, in turns
        for turn in 1 2; do
          for core in this $(cd .gpu 2>/dev/null && ls -d other* 2>/dev/null); do
            (if [ $core != this ]; then export PYTHONPATH=$PWD/.gpu/$core/core:${PYTHONPATH:-}; fi
             timeout "${SOLO_TIMEOUT:-120}" python3 bench/draft_alone.py $core) 2>&1 \
              | tee -a "$out/draft-alone.txt" | tail -1
          done
        done ;;
      pair)
        (cd bench && timeout "${PAIR_TIMEOUT:-300}" python3 batch.py --pair demo-qwen3.5 \
          --repeats "${REPEATS:-5}" --json "$out/pair-gpu.json") 2>&1 | tee "$out/pair-gpu.txt" \
          | tail -6 ;;
      soak)
        MLXRUNNER_MODELS=/tmp/store timeout "${SOAK_TIMEOUT:-540}" python3 bench/serve_soak.py \
          demo-qwen3.5 --bursts --requests "${SOAK_REQUESTS:-2000}" --minutes 8 \
          --json "$out/soak-gpu.json" 2>&1 | tee "$out/soak-gpu.txt" | tail -16 ;;
      attention)  # a Gemma 4 E2B step's attention: ours against MLX's, time a call
        (cd bench && timeout "${ATTENTION_TIMEOUT:-120}" python3 attention_device.py \
          --json "$out/attention-gpu.json") 2>&1 | tee "$out/attention-gpu.txt" | tail -6 ;;
      products)  # a Gemma 4 E2B step's products: ours against MLX's, time and GB/s
        (cd bench && timeout "${PRODUCTS_TIMEOUT:-180}" python3 product_bandwidth.py \
          --json "$out/products-gpu.json") 2>&1 | tee "$out/products-gpu.txt" | tail -10 ;;
      launch)
        (cd bench && timeout 120 python3 launch_cost.py --json "$out/launch-gpu.json") 2>&1 \
          | tee "$out/launch-gpu.txt" | tail -8 ;;
      prefill)  # where a Gemma 4 prefill's time goes, against mlx-lm's
        (cd bench && timeout "${PREFILL_TIMEOUT:-200}" python3 gemma4_prefill.py ${PREFILL_ARGS:-} \
          --json "$out/gemma4-prefill-gpu.json") 2>&1 | tee "$out/gemma4-prefill-gpu.txt" \
          | tail -24 ;;
      sweep)  # our decode step under MLX's CUDA graph settings, a process each
        (cd bench && timeout "${SWEEP_TIMEOUT:-400}" python3 mlx_env_sweep.py ${SWEEP_ARGS:-} \
          --json "$out/sweep-gpu.json") 2>&1 | tee "$out/sweep-gpu.txt" | tail -10 ;;
      startup)
        timeout "${STARTUP_TIMEOUT:-300}" python3 bench/startup.py --runs 3 \
          --json "$out/startup-gpu.json" 2>&1 | tee "$out/startup-gpu.txt" | tail -24 ;;
    esac
  done
done
(cd "$out" && tar czf results.tgz --remove-files -- *.json *.txt 2>/dev/null)
