"""What a product of a few activation rows costs, by row count, at the Qwen3.5-0.8B's
projection shapes: the product as a batched decode step or a verify block makes it, and
other ways of computing the same rows.

Ways: ``matmul`` (``x @ w.T``, the transposed view of the row-major checkpoint weight: what
MLX runs for a plain product), ``contiguous`` (the same against a ``[K, N]`` copy),
``project`` (:func:`mlxrunner.nn.kernels.project`: on CUDA, 2-16 rows as one-row
products), ``halves`` (two products of half the rows each). Each figure is microseconds
per call with ``--count`` calls queued on distinct inputs and evaluated together (the
larger of the host's submission and the device's work), and the weight bandwidth it
implies.

    python bench/row_products.py --json out.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import harness
import mlx.core as mx

from mlxrunner.nn.kernels import project

#: (name, in, out) of the 0.8B's products (hidden 1024)
SHAPES = [("deltanet in (qkv|z|b|a)", 1024, 8224), ("deltanet out", 2048, 1024),
          ("attention q|k|v", 1024, 5120), ("attention out", 2048, 1024),
          ("mlp gate|up", 1024, 7168), ("mlp down", 3584, 1024), ("head", 1024, 248320)]


def ways_for(wt_view: mx.array, wt_copy: mx.array, rows: int
             ) -> dict[str, Callable[[mx.array], mx.array]]:
    ways: dict[str, Callable[[mx.array], mx.array]] = {
        "matmul": lambda x: x @ wt_view,
        "contiguous": lambda x: x @ wt_copy,
        "project": lambda x: project(x, wt_view),
    }
    if rows >= 2:
        half = rows // 2
        ways["halves"] = lambda x: mx.concatenate([x[:half] @ wt_view, x[half:] @ wt_view])
    return ways


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=50)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    dt = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    results = []
    print(f"Row products, {str(dt).split('.')[-1]}, device {mx.default_device()}: "
          "microseconds per call (GB/s of weight read)", flush=True)
    for name, k, n in SHAPES:
        w = (0.02 * mx.random.normal((n, k))).astype(dt)
        wt_view = w.T
        wt_copy = mx.contiguous(w.T)
        mx.eval(w, wt_copy)
        for rows in args.rows:
            xs = [mx.random.normal((rows, k)).astype(dt) for _ in range(args.count)]
            mx.eval(xs)
            ways = ways_for(wt_view, wt_copy, rows)
            cells = {way: round(sum(harness.queued_us(fn, xs)), 2) for way, fn in ways.items()}
            results.append({"product": name, "in": k, "out": n, "rows": rows, "us": cells})
            print(f"  {name:24} {rows:3d} rows: " + "  ".join(
                f"{way} {us:8.1f} ({2 * k * n / us / 1e3:5.0f})" for way, us in cells.items()),
                flush=True)
    harness.write_json(args.json, {"bench": "row_products", "dtype": str(dt),
                                   "device": str(mx.default_device()), "mlx": mx.__version__,
                                   "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
