"""Time per call of a decode step's projections at the Llama-3.2-1B shape on the default
device: one product over packed q/k/v (or gate/up) weights cut by a split, against one
product per layer, and the output head. Calls are queued ``--count`` at a time on
distinct inputs (one evaluation), so a figure is the larger of the host's submission and
the device's work per call.

    python bench/projection_times.py [--count 100] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import harness
import mlx.core as mx
import mlx.nn as nn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    dt = mx.bfloat16
    hidden, inter, q_out, kv_out, vocab = 2048, 8192, 2048, 512, 128256

    def weight(rows: int, cols: int) -> mx.array:
        return (mx.random.normal((rows, cols)) * 0.02).astype(dt)

    wq, wk, wv = weight(q_out, hidden), weight(kv_out, hidden), weight(kv_out, hidden)
    wqkv = mx.concatenate([wq, wk, wv])
    wg, wu, wd = weight(inter, hidden), weight(inter, hidden), weight(hidden, inter)
    wgu = mx.concatenate([wg, wu])
    head = weight(vocab, hidden)
    mx.eval(wq, wk, wv, wqkv, wg, wu, wd, wgu, head)
    xs = [mx.random.normal((1, 1, hidden)).astype(dt) for _ in range(args.count)]
    mx.eval(xs)
    swiglu = mx.compile(lambda g, u: nn.silu(g) * u)
    cases: dict[str, Callable[[mx.array], list[mx.array]]] = {
        "q/k/v packed: one product + split": lambda x: mx.split(
            x @ wqkv.T, [q_out, q_out + kv_out], axis=-1),
        "q/k/v: three products": lambda x: [x @ wq.T, x @ wk.T, x @ wv.T],
        "gate/up packed + swiglu": lambda x: [swiglu(*mx.split(x @ wgu.T, [inter], axis=-1))],
        "gate/up: two products + swiglu": lambda x: [swiglu(x @ wg.T, x @ wu.T)],
        "down (8192 -> 2048)": lambda x: [mx.concatenate([x] * 4, axis=-1) @ wd.T],
        "output head (2048 -> 128256)": lambda x: [x @ head.T],
        "q only (2048 -> 2048)": lambda x: [x @ wq.T],
    }
    results = {}
    print(f"projection times: device {mx.default_device()}, mlx {mx.__version__}, "
          f"{args.count} calls queued", flush=True)
    for name, fn in cases.items():
        results[name] = round(sum(harness.queued_us(fn, xs)), 2)
        print(f"  {name:36s} {results[name]:8.2f} us/call", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": str(mx.default_device()),
                                         "us_per_call": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
