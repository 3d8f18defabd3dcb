"""A Gemma 4 decode step with the post-norm products' block counters made two ways, in one
process: in the GPU's own memory (the core's ``_new_counter``) against 4 bytes made from a
host value (what it was: MLX's pool of managed scalars). Medians of the per-step build,
submit and GPU wait over ``--steps`` greedy steps after a 64-token prompt, on the quick
layout (``--full``: E2B's).

    python bench/counter_ab.py [--steps 40] [--full]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import gemma4
import harness
import mlx.core as mx
import numpy as np

from mlxrunner.nn import cuda_products


def host_counter() -> mx.array:
    return mx.array(np.zeros(1, np.int32))


def timed_steps(model, steps: int) -> dict[str, float]:
    ours = harness.Ours(model)
    cache = ours.make_cache()
    prompt = mx.random.randint(0, 200, (1, 64), key=mx.random.key(0))
    y = mx.argmax(ours(prompt, cache=cache)[:, -1], -1, keepdims=True)
    mx.eval(y)
    build, submit, wait = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = mx.argmax(ours(y, cache=cache)[:, -1], -1, keepdims=True)
        t1 = time.perf_counter()
        mx.async_eval(out)
        t2 = time.perf_counter()
        mx.eval(out)
        t3 = time.perf_counter()
        y = out
        build.append(t1 - t0), submit.append(t2 - t1), wait.append(t3 - t2)
    med = lambda v: round(1e3 * statistics.median(v[3:]), 3)  # noqa: E731
    return {"build_ms": med(build), "submit_ms": med(submit), "wait_ms": med(wait)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--full", action="store_true")
    args = parser.parse_args()
    full = json.loads(gemma4.DEFAULT_CONFIG.read_text()) if gemma4.DEFAULT_CONFIG.is_file() \
        else gemma4.E2B_TEXT_CONFIG
    config = gemma4.composite(full if args.full else gemma4.QUICK_TEXT_CONFIG)
    rows = {}
    for name, maker in (("device counters", cuda_products._new_counter),
                        ("host counters", host_counter),
                        ("device counters again", cuda_products._new_counter)):
        cuda_products._new_counter = maker
        model = gemma4.build_ours(config, mx.bfloat16, 0)
        rows[name] = timed_steps(model, args.steps)
        print(f"  {name:22s} {rows[name]}", flush=True)
    print(json.dumps({"device": str(mx.default_device()), "rows": rows}))


if __name__ == "__main__":
    main()
