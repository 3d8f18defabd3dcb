"""Host time per MLX operation on the default device: how long ``mx.async_eval`` takes to
submit K independent operations of one kind (the host-side encoding of each node), per
operation, and the synchronous total. Decoding a small model is bound by these costs on
MLX's CUDA backend (the GPU waits for the host), so they decide which compositions pay.

    python bench/op_costs.py [--hidden 1536] [--count 200] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx


def costs(hidden: int, count: int) -> dict[str, dict[str, float]]:
    x = [mx.random.normal((1, hidden)).astype(mx.bfloat16) for _ in range(count)]
    weight_t = mx.random.normal((2048, hidden)).astype(mx.bfloat16).T
    residual = mx.random.normal((1, 2048)).astype(mx.bfloat16)
    norm_weight = mx.ones((hidden,), mx.bfloat16)
    mx.eval(x, weight_t, residual, norm_weight)
    swiglu = mx.compile(lambda a, b: a * mx.sigmoid(a) * b)
    # a KV buffer of 1024 positions (attention itself: bench/sdpa_paths.py)
    buffer = mx.zeros((1, 1, 1024, hidden), mx.bfloat16)
    write_at = mx.array([600], mx.int32)
    mx.eval(buffer, write_at)
    ops = {
        f"matmul (1x{hidden} @ {hidden}x2048)": lambda a: a @ weight_t,
        "addmm (same, plus a residual)": lambda a: mx.addmm(residual, a, weight_t),
        "matmul then add": lambda a: a @ weight_t + residual,
        "rms_norm": lambda a: mx.fast.rms_norm(a, norm_weight, 1e-6),
        "add": lambda a: a + a,
        "compiled swiglu": lambda a: swiglu(a, a),
        "rope": lambda a: mx.fast.rope(a.reshape(1, 1, 1, hidden), 64, traditional=False,
                                       base=1e4, scale=1.0, offset=5),
        "argmax": lambda a: mx.argmax(a, axis=-1),
        "split in two": lambda a: mx.split(a, [hidden // 2], axis=-1)[0],
        "softmax": lambda a: mx.softmax(a, axis=-1),
        "where (select)": lambda a: mx.where(a > 0, a, -a),
        "slice_update (dynamic start)": lambda a: mx.slice_update(buffer, a[None, None],
                                                                  write_at, (2,)),
    }
    if hasattr(mx, "cuda") and mx.cuda.is_available() and mx.default_device() == mx.gpu:
        kernel = mx.fast.cuda_kernel(
            name="op_costs_double", input_names=["inp"], output_names=["out"],
            source="int i = blockIdx.x * blockDim.x + threadIdx.x;"
                   " if (i < N) out[i] = inp[i] * (T)2;")
        ops["custom kernel (trivial)"] = lambda a: kernel(
            inputs=[a], template=[("T", a.dtype), ("N", a.shape[1])], grid=(a.shape[1], 1, 1),
            threadgroup=(256, 1, 1), output_shapes=[a.shape], output_dtypes=[a.dtype])[0]
    inputs = {name: x for name in ops}
    # Matmuls of a few rows (speculative verify blocks): MLX's CUDA backend has a
    # matrix-vector kernel for one row only; more rows go to its general GEMM path.
    for m in (2, 4, 8, 16):
        name = f"matmul ({m}x{hidden} @ {hidden}x2048)"
        inputs[name] = [mx.random.normal((m, hidden)).astype(mx.bfloat16) for _ in range(count)]
        ops[name] = lambda a: a @ weight_t
    name = "same 8 rows as 8 one-row matmuls"
    inputs[name] = inputs[f"matmul (8x{hidden} @ {hidden}x2048)"]
    ops[name] = lambda a: (a[:, None, :] @ weight_t[None])[:, 0]
    mx.eval(list(inputs.values()))
    results = {}
    for name, op in ops.items():
        for _ in range(3):  # the last of three: compiled, allocated
            outs = [op(a) for a in inputs[name]]
            start = time.perf_counter()
            mx.async_eval(outs)
            submitted = time.perf_counter()
            mx.eval(outs)
            done = time.perf_counter()
        results[name] = {"submit_us": 1e6 * (submitted - start) / count,
                         "total_us": 1e6 * (done - start) / count}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    print(f"op costs: device {mx.default_device()}, mlx {mx.__version__}, "
          f"{args.count} operations of each kind", flush=True)
    results = costs(args.hidden, args.count)
    for name, r in results.items():
        print(f"  {name:34s} submit {r['submit_us']:7.2f} us/op   total "
              f"{r['total_us']:7.2f} us/op", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": str(mx.default_device()),
                                         "mlx": mx.__version__,
                                         "platform": platform.platform(),
                                         "count": args.count, "costs": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
