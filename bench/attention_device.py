"""A Gemma 4 E2B decode step's attention (8 query heads over one key/value head, one query
row a head) through ``mlxrunner.nn.attend`` (on CUDA the core's fused kernel, its keys split
over the GPU), through the core's folded form, and through MLX's function
(``mx.fast.scaled_dot_product_attention``: on MLX 0.32's CUDA backend its fallback
operations for these shapes): time per call of ``--count`` calls queued, and on CUDA the
device's own time for one call alone (``bench/device_clock.py``), medians of ``--repeats``.
Beside each path, its largest difference from MLX's function on the same float32 inputs.

    python bench/attention_device.py [--count 64] [--repeats 5] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

import device_clock
import harness
import mlx.core as mx

import mlxrunner.nn as mnn
from mlxrunner import settings

HEADS = 8


def cases(scale: int) -> dict[str, tuple[int, int, int | None]]:
    """name: (head dim, buffer length, live keys or None for all); ``scale`` divides the
    sizes (the CPU-sized layout)."""
    return {
        "sliding layer: a full ring of 512, head 256": (256 // scale, 512 // scale, None),
        "full layer: 640 keys of a 1024 buffer, head 512": (512 // scale, 1024 // scale,
                                                           640 // scale),
        "full layer: 6000 keys of an 8192 buffer, head 512": (512 // scale, 8192 // scale,
                                                             6000 // scale),
    }


def paths(k: mx.array, v: mx.array, mask: mx.array | None
          ) -> dict[str, Callable[[mx.array], mx.array]]:
    def ours(q: mx.array) -> mx.array:
        return mnn.attend(q, k, v, mask, scale=1.0)

    def folded(q: mx.array) -> mx.array:
        with settings.overridden(attention="folded"):
            return mnn.attend(q, k, v, mask, scale=1.0)

    def theirs(q: mx.array) -> mx.array:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask=mask)

    return {"mlxrunner": ours, "folded": folded, "mlx": theirs}


def _gap(q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None) -> dict[str, float]:
    """Each path's largest difference from MLX's function, all in float32."""
    f32 = paths(k.astype(mx.float32), v.astype(mx.float32), mask)
    q32 = q.astype(mx.float32)
    want = f32["mlx"](q32)
    return {name: mx.abs(fn(q32) - want).max().item() for name, fn in f32.items()
            if name != "mlx"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_call_arguments(parser, "sizes / 4 (the CPU)")
    args = parser.parse_args(argv)
    scale = 4 if args.quick else 1
    print(f"attention a decode step: {mx.default_device()}, mlx {mx.__version__}, {HEADS} "
          f"query heads over 1, bf16, {args.count} calls queued, medians of {args.repeats}",
          flush=True)
    results: dict[str, dict[str, Any]] = {}
    for name, (dim, length, live) in cases(scale).items():
        keys = mx.random.split(mx.random.key(dim + length), 3)
        k = mx.random.normal((1, 1, length, dim), key=keys[0]).astype(mx.bfloat16)
        v = mx.random.normal((1, 1, length, dim), key=keys[1]).astype(mx.bfloat16)
        mask = None if live is None else mx.arange(length) < live
        qs = [mx.random.normal((1, HEADS, 1, dim), key=mx.random.key(100 + n))
              .astype(mx.bfloat16) for n in range(args.count)]
        mx.eval(k, v, qs, *([] if mask is None else [mask]))
        fns = paths(k, v, mask)
        times: dict[str, list[float]] = {who: [] for who in fns}
        for _ in range(args.repeats):
            for who, fn in fns.items():
                times[who].append(harness.queued_us(fn, qs)[1])
        row: dict[str, Any] = {f"{who}_us": statistics.median(t) for who, t in times.items()}
        row["max_abs_vs_mlx_float32"] = _gap(qs[0], k, v, mask)
        if device_clock.available():  # one call alone on the device: a decode step's chain
            for who, fn in fns.items():
                row[f"{who}_device_us"] = device_clock.call_us([fn], qs[0])
        results[name] = row
        device = "" if "mlx_device_us" not in row else "   device a call alone: " + " / ".join(
            "host behind" if row[f"{who}_device_us"] is None else f"{row[f'{who}_device_us']:.1f}"
            for who in fns) + " us"
        print(f"  {name:50s} ours {row['mlxrunner_us']:7.2f}  folded {row['folded_us']:7.2f}  "
              f"MLX {row['mlx_us']:7.2f} us a call{device}   float32 gap "
              f"{max(row['max_abs_vs_mlx_float32'].values()):.1e}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": str(mx.default_device()), "mlx": mx.__version__,
                                         "count": args.count, "cases": results}, indent=1)
                             + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
