"""Which path MLX's fused attention takes for our decode and verify shapes on this device:
for each head dim, query count and mask kind, the operations of the call's graph (one
ScaledDotProductAttention node when a fused kernel serves it, else the fallback's
operations), whether ``force_fused=True`` is accepted, and the time per call of 100 calls
submitted at once. When a new MLX serves these shapes, ``mlxrunner.nn.attend`` may hand them
back to it.

    python bench/sdpa_paths.py
"""

from __future__ import annotations

import time

import mlx.core as mx
from harness import VIEWS, graph_labels


def operations(out: mx.array) -> list[str]:
    """The call's operations, views and dtype casts left out."""
    return [op for op in graph_labels(out) if op not in VIEWS and op != "AsType"]


def main() -> None:
    print(f"sdpa paths: device {mx.default_device()}, mlx {mx.__version__}; 8 query heads, "
          "1 key/value head, 1024 keys, bfloat16", flush=True)
    keys_n = 1024
    for dim in (64, 256, 512):
        for queries in (1, 8):
            q = mx.random.normal((1, 8, queries, dim)).astype(mx.bfloat16)
            k = mx.random.normal((1, 1, keys_n, dim)).astype(mx.bfloat16)
            v = mx.random.normal((1, 1, keys_n, dim)).astype(mx.bfloat16)
            valid = mx.arange(keys_n)[None] <= 600 + mx.arange(queries)[:, None]
            masks = {"none": None, "bool": valid,
                     "additive": mx.where(valid, 0.0, -mx.inf).astype(mx.bfloat16)}
            mx.eval(q, k, v, valid, masks["additive"])
            for name, mask in masks.items():
                def call(mask=mask, dim=dim, q=q, k=k, v=v) -> mx.array:
                    return mx.fast.scaled_dot_product_attention(q, k, v, scale=dim ** -0.5,
                                                                mask=mask)
                ops = operations(call())
                try:
                    mx.eval(mx.fast.scaled_dot_product_attention(
                        q, k, v, scale=dim ** -0.5, mask=mask, force_fused=True))
                    fused = "yes"
                except ValueError:
                    fused = "no"
                mx.eval(call())
                outs = [call() for _ in range(100)]
                start = time.perf_counter()
                mx.eval(outs)
                per_call = 1e4 * (time.perf_counter() - start)
                print(f"  head dim {dim}, {queries} queries, mask {name:8s}: force_fused "
                      f"{fused:3s}  {per_call:7.1f} us/call  {' '.join(ops)}", flush=True)


if __name__ == "__main__":
    main()
