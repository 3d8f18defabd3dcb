"""Host time per kernel launch on MLX's CUDA backend: built-in operations against custom
kernels (``mx.fast.cuda_kernel``), the same custom kernel with its source padded to several
lengths.

Why: on the H100 (bench/results/2026-12-05i-h100) a decode step of ours launched 181 kernels
for the Llama-1B shape against mlx-lm's 276 and still submitted slower (1.78 ms against
1.62): about 15 us a custom kernel against 6 us a built-in one. MLX's
``CustomKernel::eval_gpu`` hashes the kernel's whole source (for a precompiled kernel, its
cubin) at every launch to find its module; if that is the cost, the time a launch takes grows
with the source's length here. Also prints the sizes of the cubins the core built (the
``mlxrunner`` folder in ``MLX_PTX_CACHE_DIR``), the lengths the core's launches hash.
Confirmed on the H100 (bench/results/2026-12-05j-h100): 0.3-0.4 us a KiB. Then the same for
the core's own layers: one-row bf16 products, MLX's ``nn.Linear`` against
``mlxrunner.nn.Linear`` (the fused product kernel), alone and after an RMS norm (two MLX
kernels against the core's one).

    python bench/launch_cost.py [--launches 200] [--repeats 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import mlx.core as mx

BODY = """
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) { out[i] = x[i] + 1.0f; }
"""


def custom_kernel(padding: int):
    # a comment of ``padding`` bytes: the kernel is the same, its source longer
    source = BODY + ("// " + "x" * 77 + "\n") * (padding // 81)
    return mx.fast.cuda_kernel(name=f"launch_cost_{padding}", input_names=["x"],
                               output_names=["out"], source=source)


def chain_builtin(x: mx.array, launches: int) -> mx.array:
    # a scan: mx.compile fuses a chain of elementwise operations into one kernel
    for _ in range(launches):
        x = mx.cummax(x)
    return x


def chain_custom(kernel, x: mx.array, launches: int) -> mx.array:
    for _ in range(launches):
        (x,) = kernel(inputs=[x], template=[("N", x.size)], grid=(x.size, 1, 1),
                      threadgroup=(256, 1, 1), output_shapes=[x.shape], output_dtypes=[x.dtype])
    return x


def chain_layers(layers: list, x: mx.array) -> mx.array:
    for layer in layers:
        x = layer(x)
    return x


def product_rows(launches: int, repeats: int) -> dict[str, list[float]]:
    """One-row bf16 products (2048 x 2048, a decode step's shape) chained: MLX's nn.Linear
    against the core's mlxrunner.nn.Linear (its fused product kernel on CUDA), and a norm
    before each (MLX: two kernels; the core: the norm inside the product)."""
    import mlx.nn as nn

    import mlxrunner.nn as mnn

    def made(kind: type, count: int, *args: int) -> list:
        out = []
        for _ in range(count):
            layer = kind(*args)
            layer.set_dtype(mx.bfloat16)
            out.append(layer)
        mx.eval([layer.parameters() for layer in out])
        return out

    x = mx.random.normal((1, 2048)).astype(mx.bfloat16) * 0.1
    # 8 distinct weights taken in turns (a step reads a different weight each product)
    theirs, ours = made(nn.Linear, 8, 2048, 2048, False), made(mnn.Linear, 8, 2048, 2048,
                                                               False)
    norms, our_norms = made(nn.RMSNorm, 8, 2048), made(mnn.RMSNorm, 8, 2048)

    def chain(layers: list, count: int) -> list:
        return [layers[i % len(layers)] for i in range(count)]

    def normed(norm_layers: list, linear_layers: list, count: int) -> list:
        return [f for i in range(count) for f in (norm_layers[i % 8], linear_layers[i % 8])]

    half = launches // 2
    return {
        "MLX nn.Linear, 1 row": per_launch_us(
            lambda y: chain_layers(chain(theirs, launches), y), launches, repeats, x),
        "core Linear (fused product)": per_launch_us(
            lambda y: chain_layers(chain(ours, launches), y), launches, repeats, x),
        "MLX RMSNorm + Linear (2 kernels)": per_launch_us(
            lambda y: chain_layers(normed(norms, theirs, half), y), 2 * half, repeats, x),
        "core RMSNorm + Linear (1 kernel)": per_launch_us(
            lambda y: chain_layers(normed(our_norms, ours, half), y), 2 * half, repeats, x),
    }


def per_launch_us(function, launches: int, repeats: int,
                  x: mx.array | None = None) -> list[float]:
    """Host time per launch of a compiled chain (build, submit and the wait, which for
    these tiny kernels is the GPU running them back to back); ``launches``: the operations
    the chain holds (for the core's fused rows: the operations it stands for)."""
    x = mx.zeros((1024,), dtype=mx.float32) if x is None else x
    mx.eval(function(x))  # eagerly first: the core's kernels settle their self-checks
    compiled = mx.compile(function)
    mx.eval(compiled(x))  # trace, build
    times = []
    for _ in range(repeats):
        mx.synchronize()
        started = time.perf_counter()
        mx.eval(compiled(x))
        mx.synchronize()
        times.append(1e6 * (time.perf_counter() - started) / launches)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
        raise SystemExit("launch_cost.py measures MLX's CUDA backend: no CUDA device here")
    rows: dict[str, list[float]] = {
        "built-in cummax": per_launch_us(lambda x: chain_builtin(x, args.launches),
                                      args.launches, args.repeats)}
    for padding in (0, 16384, 65536):
        kernel = custom_kernel(padding)
        rows[f"custom kernel, source +{padding // 1024} KiB"] = per_launch_us(
            lambda x, k=kernel: chain_custom(k, x, args.launches), args.launches, args.repeats)
    rows.update(product_rows(args.launches, args.repeats))
    print(f"host time per launch, {args.launches} launches a graph, median of "
          f"{args.repeats} [min - max], device {mx.default_device()}, mlx {mx.__version__}")
    for name, times in rows.items():
        print(f"  {name:34s} {statistics.median(times):7.2f} us  "
              f"[{min(times):.2f} - {max(times):.2f}]")
    folder = Path(os.environ.get("MLX_PTX_CACHE_DIR", "/nonexistent")) / "mlxrunner"
    sizes = sorted(p.stat().st_size for p in folder.glob("*.cubin")) if folder.is_dir() else []
    if sizes:
        print(f"  the core's cubins in {folder}: {len(sizes)}, bytes median "
              f"{statistics.median(sizes):.0f}, range {sizes[0]}-{sizes[-1]}")
    if args.json:
        args.json.write_text(json.dumps({"launches": args.launches, "rows_us": rows,
                                         "cubin_bytes": sizes}, indent=1))
        print(f"  wrote {args.json}")


if __name__ == "__main__":
    main()
