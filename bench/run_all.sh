#!/usr/bin/env bash
# Every benchmark, one after the other, JSON into $1 (default bench/results). Used as is on the
# GPU machine and on the CPU; each run prints its own table.
set -u
out=${1:-bench/results}
mkdir -p "$out"
dev=$(python3 -c 'import mlx.core as mx; print("gpu" if mx.default_device() == mx.gpu else "cpu")')
quick=""
[ "$dev" = cpu ] && quick="--quick"
export PYTHONUNBUFFERED=1
run() { echo "== $*"; timeout "${BENCH_TIMEOUT:-240}" "$@" || echo "!! exit $? for: $*"; }
run python3 bench/topk.py $quick --json "$out/topk-$dev.json"
run python3 bench/qwen3_5.py $quick --json "$out/qwen3_5-$dev.json"
run python3 bench/gemma4.py $quick --json "$out/gemma4-$dev.json"
run python3 bench/speculative.py $quick --json "$out/speculative-$dev.json"
# the embedded demo pair, greedy, speculative beside plain (best of 3 after 2 warm-ups)
run mlxrunner bench default --prompt "def fibonacci(n):" --max-tokens 128 --repeats 3 \
  --warmup 2 --json "$out/demo-$dev.json"
# the same pair's round, part by part per depth
run python3 bench/speculative.py --model default --json "$out/speculative-demo-$dev.json"
