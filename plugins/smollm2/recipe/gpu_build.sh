#!/usr/bin/env bash
# The default pair's draft, built and measured on the GPU machine (no package index there):
# the GGUF file travels in three parts (.gguf-a/-b/-c, each under the device's 64 MiB a call),
#   call: bash plugins/smollm2/recipe/gpu_build.sh part a|b|c   (moves a part to /tmp/gguf)
#   call: bash plugins/smollm2/recipe/gpu_build.sh answers      (the target's answers, then a
#         two-step training run of the same shapes: MLX compiles the trainer's kernels there)
#   call: bash plugins/smollm2/recipe/gpu_build.sh build        (answers, train-draft, q8 copy)
#         training longer than one call (10 minutes): TRAIN_S is the budget of all calls,
#         BUILD_ARGS="--stop-at 900" in the first (a checkpoint there), "--resume" in the next
#   call: bash plugins/smollm2/recipe/gpu_build.sh bench        (bench/default_model.py)
#   call: bash plugins/smollm2/recipe/gpu_build.sh probe        (bench/batch.py --pair smol-q8)
# after `bash .mlx-cuda-a/stage.sh`, with .mlx-cuda-b and .whl carried with part a, and .gpu
# (MLX's compiled kernels) carried in every call that runs MLX (answers, build, bench): a
# carried .gpu was gone one call later on the 2026-12-03 machine, and without it the
# trainer's first step compiles for about 165 s. The kernels live in /tmp/ptx-cache on the
# machine (a carried .gpu replaces the folder there, and the kernels with it).
# The parts, here (each folder listed in .git/info/exclude), from the store's copy of the file:
#   G=~/.mlxrunner/models/smollm2%3A135m/SmolLM2-135M-Instruct.Q4_1.gguf
#   head -c 17000000 $G > .gguf-a/part; tail -c +17000001 $G | head -c 40500000 > .gguf-b/part
#   tail -c +57500001 $G > .gguf-c/part
# (part a travels beside .mlx-cuda-b and .whl, part c beside .gpu and .smolbuild: each call's
# carried paths and the repository under the 64 MiB a call; bench/carry_size.sh PATHS says)
set -u
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out" /tmp/gguf
gguf=/tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
setup() {
  source .mlx-cuda-b/env.sh >/dev/null && source bench/gpu_setup.sh >/dev/null 2>&1
  export PYTHONUNBUFFERED=1 MLXRUNNER_MODELS=/tmp/store MLX_PTX_CACHE_DIR=/tmp/ptx-cache
  export MLXRUNNER_SHARED_DATA=$PWD/.gpu/shared-data
  mkdir -p "$MLX_PTX_CACHE_DIR"
  [ -f /tmp/ptx-restored ] ||
    { bash bench/ptx_cache.sh restore "$MLX_PTX_CACHE_DIR" && touch /tmp/ptx-restored; }
  if [ ! -f "$gguf" ] && [ -f /tmp/gguf/part-a ] && [ -f /tmp/gguf/part-b ] &&
     [ -f /tmp/gguf/part-c ]; then
    cat /tmp/gguf/part-a /tmp/gguf/part-b /tmp/gguf/part-c > "$gguf.tmp" && mv "$gguf.tmp" "$gguf"
  fi
  [ -f "$gguf" ] && sha256sum "$gguf"
  # answers written elsewhere (on a CPU: build_draft.py --answers-only --out .smolbuild,
  # the same --train-prompts; or an earlier machine's, gzipped: 9,472 are 13.6 MB as text,
  # 1.7 MB gzipped), carried as .smolbuild: answering goes on after them
  if [ -d .smolbuild ] && [ ! -f /tmp/smolbuild/answers-train.jsonl ]; then
    mkdir -p /tmp/smolbuild
    for f in .smolbuild/answers-*.jsonl; do [ -f "$f" ] && cp "$f" /tmp/smolbuild/; done
    for f in .smolbuild/answers-*.jsonl.gz; do
      [ -f "$f" ] && gunzip -c "$f" > "/tmp/smolbuild/$(basename "$f" .gz)"
    done
  fi
  # the kernels MLX compiled come back whatever happens (cat $OUT/ptx-cache.txz.* into
  # .gpu/ptx-cache.txz here: the next machine starts with them, the trainer's first step too)
  trap 'bash bench/ptx_cache.sh save "$MLX_PTX_CACHE_DIR" "$out"' EXIT
}
build_args() {
  echo plugins/smollm2/recipe/build_draft.py "$gguf" --out /tmp/smolbuild \
    --train-prompts "${PROMPTS:-13000}" --batch "${ANSWER_BATCH:-64}" \
    --max-tokens "${MAX_TOKENS:-256}" --target-dtype "${TARGET_DTYPE:-bfloat16}" \
    --layers "${LAYERS:-3}" --answer-time-s "${ANSWER_S:-200}"
}
case "${1:-}" in
  part)
    cp ".gguf-$2/part" "/tmp/gguf/part-$2" && ls -la /tmp/gguf
    if [ "$2" = a ]; then setup; python3 -c 'import mlxrunner, mlx.core as mx; print(mx.default_device())'; fi
    ;;
  answers)
    setup
    timeout "${BUILD_TIMEOUT:-300}" python3 $(build_args) --answers-only 2>&1 | tee "$out/answers.log" | tail -5
    # the trainer's kernels compiled here, not in the timed build (its first step took 207 s)
    rm -rf /tmp/smolwarm && cp -r /tmp/smolbuild /tmp/smolwarm
    timeout "${WARM_TIMEOUT:-270}" python3 $(build_args | sed 's|/tmp/smolbuild|/tmp/smolwarm|') \
      --steps 2 --reuse-answers 2>&1 | tee "$out/warm.log" | grep -v "^step " | tail -8
    ;;
  build)
    setup
    # answers already written by an `answers` call on this machine are reused
    timeout "${BUILD_TIMEOUT:-540}" python3 $(build_args) --reuse-answers --time-budget-s "${TRAIN_S:-420}" \
      ${BUILD_ARGS:-} 2>&1 | tee "$out/build.log" | grep -v "^step " | tail -30
    # the shipped draft: 8-bit (a quarter of float32's bytes; the repository must stay small)
    printf 'FROM %s\nDRAFT /tmp/smolbuild/draft\n' "$gguf" > /tmp/Modelfile.smol
    python3 -m mlxrunner.cli create smol-q8 -f /tmp/Modelfile.smol --draft-quantize q8 2>&1 | tail -3
    (cd /tmp/store && d=$(ls -d */ | grep -i smol | head -1) && tar czf /tmp/draft.tgz -C "$d" draft &&
      split -b 15m /tmp/draft.tgz "$out/draft-q8.tgz.")
    (cd /tmp/smolbuild && tar czf "$out/build-extra.tgz" draft/config.json draft/report.json train-log.jsonl answers-heldout.jsonl answers-train.jsonl 2>/dev/null)
    ls -la "$out"
    ;;
  bench)
    setup
    timeout "${BENCH_TIMEOUT:-300}" python3 bench/default_model.py smol-q8 --prompts "${BENCH_PROMPTS:-40}" \
      --json "$out/default-model-gpu.json" 2>&1 | tee "$out/default-model-gpu.txt" | tail -6
    if [ "${MTP:-1}" = 1 ]; then
      timeout 150 python3 bench/mtp.py --json "$out/mtp-gpu.json" 2>&1 | tee "$out/mtp-gpu.txt" | tail -14
    fi
    ;;
  probe)
    # the scheduler on this model (answering at 64 rows: 529 tok/s with MLX compiling its
    # kernels, 4,005 with them carried in .gpu; a 0.8B Qwen3.5 at 32 rows 5031): drafts in
    # the batch against without
    setup
    timeout "${BENCH_TIMEOUT:-300}" python3 bench/batch.py --pair smol-q8 --streams 1 8 64 \
      --new 64 --repeats 1 --json "$out/batch-smol-gpu.json" 2>&1 | tee "$out/batch-smol-gpu.txt" | tail -12
    ;;
  moe)
    setup
    timeout "${BENCH_TIMEOUT:-400}" python3 bench/qwen3_5_moe.py --bits 4 --json "$out/qwen3_5-moe-gpu.json" \
      2>&1 | tee "$out/qwen3_5-moe-gpu.txt" | tail -16
    ;;
esac
