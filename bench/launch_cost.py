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
``mlxrunner.nn.Linear`` (the fused product kernel), alone and after an RMS norm (MLX's norm
before either product); a post-norm's residual add (``RMSNorm.add_normed``: MLX's norm and add
against the core's one kernel) and attention's heads (``attention_heads`` of a query, a key and
a value: MLX's three norms and two RoPEs against the core's one kernel), and the core's product
launched as its cubin rather than its packed image (``MLXRUNNER_PACKED_KERNELS=0``). Each row
gives the host's share (until the chain is submitted) beside the whole time (until the GPU is
done): a fused kernel that is cheap to submit may still run slower. Last, a kernel's scalar
inputs: in MLX's managed scalar pool or their own allocation (``scalar_rows``), and what
each input and each output costs a launch (``input_rows``, ``output_rows``).

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
    against the core's mlxrunner.nn.Linear (its fused product kernel on CUDA), and MLX's
    norm before each (two kernels either way)."""
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
    from mlxrunner import settings

    def as_cubins() -> list[float]:
        # the same launches handing MLX the cubins, not the packed images
        # (MLXRUNNER_PACKED_KERNELS=0): what MLX hashes at every launch, 3x longer
        with settings.overridden(packed_kernels=False):
            return per_launch_us(lambda y: chain_layers(chain(ours, launches), y), launches,
                                 repeats, x)

    return {
        "MLX nn.Linear, 1 row": per_launch_us(
            lambda y: chain_layers(chain(theirs, launches), y), launches, repeats, x),
        "core Linear (fused product)": per_launch_us(
            lambda y: chain_layers(chain(ours, launches), y), launches, repeats, x),
        "core Linear, launched as cubins": as_cubins(),
        "MLX RMSNorm + Linear (2 kernels)": per_launch_us(
            lambda y: chain_layers(normed(norms, theirs, half), y), 2 * half, repeats, x),
        "MLX RMSNorm + core Linear (2)": per_launch_us(
            lambda y: chain_layers(normed(our_norms, ours, half), y), 2 * half, repeats, x),
    }


def per_launch_us(function, launches: int, repeats: int,
                  x: mx.array | None = None, per_step: bool = False) -> list[float]:
    """Time per launch of a compiled chain (build, submit and the wait, which for these
    tiny kernels is the GPU running them back to back); ``launches``: the operations the
    chain holds (for the core's fused rows: the operations it stands for). The host's share
    alone (build and submit) is kept in ``HOST_US`` under the same list's id. ``per_step``:
    the function also takes an int32 scalar made from a host value for every call, and the
    host reads the result back (as a decode step does)."""
    x = mx.zeros((1024,), dtype=mx.float32) if x is None else x

    def args(step: int) -> tuple[mx.array, ...]:
        return (x, mx.array(step, dtype=mx.int32)) if per_step else (x,)

    mx.eval(function(*args(0)))  # eagerly first: the core's kernels settle their self-checks
    compiled = mx.compile(function)
    mx.eval(compiled(*args(0)))  # trace, build
    times, host = [], []
    for step in range(repeats):
        mx.synchronize()
        started = time.perf_counter()
        out = compiled(*args(step))
        mx.async_eval(out)
        submitted = time.perf_counter()
        mx.eval(out)
        if per_step:
            out[:1].item()
        mx.synchronize()
        times.append(1e6 * (time.perf_counter() - started) / launches)
        host.append(1e6 * (submitted - started) / launches)
    HOST_US[id(times)] = host
    return times


#: each row's host share (see :func:`per_launch_us`), by the id of its list of times
HOST_US: dict[int, list[float]] = {}


def norm_rows(launches: int, repeats: int) -> dict[str, list[float]]:
    """A post-norm's residual add (hidden 1536) and attention's heads (8 query heads, one
    key and one value head of 256, Gemma 4 E2B's sliding layers), chained: MLX's operations
    against the core's kernel."""

    import mlxrunner.nn as mnn

    def weights(count: int, dims: int) -> list[mx.array]:
        out = [(1 + 0.1 * mx.random.normal((dims,))).astype(mx.bfloat16) for _ in range(count)]
        mx.eval(out)
        return out

    h = (mx.random.normal((1, 1, 1536)) * 0.1).astype(mx.bfloat16)
    norm_weights = weights(8, 1536)
    our_norms = []
    for w in norm_weights:
        norm = mnn.RMSNorm(1536, 1e-6)
        norm.weight = w
        our_norms.append(norm)

    def mlx_add_norm(y: mx.array, count: int) -> mx.array:
        for i in range(count):
            y = y + mx.fast.rms_norm(y, norm_weights[i % 8], 1e-6)
        return y

    def core_add_norm(y: mx.array, count: int) -> mx.array:
        for i in range(count):
            y = our_norms[i % 8].add_normed(y, y)
        return y

    q = (mx.random.normal((1, 1, 8, 256))).astype(mx.bfloat16)
    k = (mx.random.normal((1, 1, 1, 256))).astype(mx.bfloat16)
    head_weights = weights(2, 256)
    q_norm, k_norm = mnn.RMSNorm(256, 1e-6), mnn.RMSNorm(256, 1e-6)
    q_norm.weight, k_norm.weight = head_weights
    rope = mnn.RoPE(256, base=10000.0)
    offset = mx.array(300, dtype=mx.int32)

    def mlx_heads(y: mx.array, count: int) -> mx.array:
        for _ in range(count):
            a = mx.fast.rope(mx.fast.rms_norm(y, head_weights[0], 1e-6).transpose(0, 2, 1, 3),
                             256, traditional=False, base=10000.0, scale=1.0, offset=offset)
            b = mx.fast.rope(mx.fast.rms_norm(k, head_weights[1], 1e-6).transpose(0, 2, 1, 3),
                             256, traditional=False, base=10000.0, scale=1.0, offset=offset)
            c = mx.fast.rms_norm(k, None, 1e-6).transpose(0, 2, 1, 3)
            y = (a + b + c).transpose(0, 2, 1, 3)  # (one more kernel each: the sum)
        return y

    def core_heads(y: mx.array, count: int) -> mx.array:
        for _ in range(count):
            a, b, c = mnn.attention_heads(offset, (y, q_norm, rope), (k, k_norm, rope),
                                          (k, 1e-6, None))
            y = (a + b + c).transpose(0, 2, 1, 3)
        return y

    per = launches // 6
    return {
        "MLX norm + add (2 kernels)": per_launch_us(
            lambda y: mlx_add_norm(y, launches // 2), 2 * (launches // 2), repeats, h),
        "core add_normed (1 kernel)": per_launch_us(
            lambda y: core_add_norm(y, launches // 2), 2 * (launches // 2), repeats, h),
        "MLX heads (5 kernels + a sum)": per_launch_us(
            lambda y: mlx_heads(y, per), 6 * per, repeats, q),
        "core heads (1 kernel + a sum)": per_launch_us(
            lambda y: core_heads(y, per), 6 * per, repeats, q),
    }


SCALED = """
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) { out[i] = x[i] * s[0] + (float)o[0]; }
"""


def scalar_rows(launches: int, repeats: int) -> dict[str, list[float]]:
    """A custom kernel over 256 blocks reading two scalars: a constant ``s`` and a per-step
    value ``o`` the host makes for every call (a decode step's offset). MLX serves arrays of
    at most 8 bytes from one pool of managed memory the host also writes (the step's
    offset, the sampled token): a GPU read from a page the host last touched crosses the
    bus. Rows: the constant in that pool (4 bytes), in its own allocation (the first of 4
    floats: 16 bytes), and without the per-step value."""
    kernel = mx.fast.cuda_kernel(name="launch_cost_scaled", input_names=["x", "s", "o"],
                                 output_names=["out"], source=SCALED)
    pooled = mx.array([1.0], dtype=mx.float32)
    own = mx.array([1.0, 0.0, 0.0, 0.0], dtype=mx.float32)[:1]
    mx.eval(pooled, own)

    def chain(y: mx.array, s: mx.array, o: mx.array) -> mx.array:
        for _ in range(launches):
            (y,) = kernel(inputs=[y, s, o], template=[("N", y.size)], grid=(y.size, 1, 1),
                          threadgroup=(256, 1, 1), output_shapes=[y.shape],
                          output_dtypes=[y.dtype])
        return y

    x = mx.zeros((65536,), dtype=mx.float32)
    steady = mx.zeros((4,), dtype=mx.int32)[:1]
    mx.eval(steady)
    return {
        "scalar in MLX's pool + per-step": per_launch_us(
            lambda y, o: chain(y, pooled, o), launches, repeats, x, per_step=True),
        "scalar own 16 B + per-step": per_launch_us(
            lambda y, o: chain(y, own, o), launches, repeats, x, per_step=True),
        "scalar in MLX's pool, no per-step": per_launch_us(
            lambda y: chain(y, pooled, steady), launches, repeats, x),
        "scalar own 16 B, no per-step": per_launch_us(
            lambda y: chain(y, own, steady), launches, repeats, x),
    }


def input_rows(launches: int, repeats: int) -> dict[str, list[float]]:
    """The same custom kernel (one output, the sum of its first input and one entry of each
    other) taking 1, 4, 8 and 12 inputs: the others 16-byte arrays of their own (what each
    input costs a launch; a post norm's product takes 9), or ("made in the graph") the
    outputs of the launches before it, each a dependency MLX records as an edge of the
    step's CUDA graph (a decode layer's kernels read the residual stream and the outputs
    of several kernels before them)."""
    rows = {}
    x = mx.zeros((1024,), dtype=mx.float32)
    for count in (1, 4, 8, 12):
        names = ["x"] + [f"a{i}" for i in range(1, count)]
        body = "    float extra = 0.f;\n" + "".join(
            f"    extra += {name}[0];\n" for name in names[1:]) + \
            "    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;\n" + \
            "    if (i < N) { out[i] = x[i] + extra; }\n"
        kernel = mx.fast.cuda_kernel(name=f"launch_cost_inputs_{count}", input_names=names,
                                     output_names=["out"], source=body)
        others = [mx.zeros((4,), dtype=mx.float32) for _ in names[1:]]
        mx.eval(others)

        def chain(y: mx.array, k=kernel, extra=tuple(others)) -> mx.array:
            for _ in range(launches):
                (y,) = k(inputs=[y, *extra], template=[("N", y.size)], grid=(y.size, 1, 1),
                         threadgroup=(256, 1, 1), output_shapes=[y.shape],
                         output_dtypes=[y.dtype])
            return y

        def chain_made(y: mx.array, k=kernel, others=count - 1) -> mx.array:
            recent = [y] * others  # the last launches' outputs (the input itself at first)
            for _ in range(launches):
                (out,) = k(inputs=[y, *recent[-others:]] if others else [y],
                           template=[("N", y.size)], grid=(y.size, 1, 1),
                           threadgroup=(256, 1, 1), output_shapes=[y.shape],
                           output_dtypes=[y.dtype])
                recent.append(y)
                y = out
            return y

        rows[f"custom kernel, {count} inputs"] = per_launch_us(chain, launches, repeats, x)
        if count > 1:
            rows[f"custom kernel, {count} made in the graph"] = per_launch_us(
                chain_made, launches, repeats, x)
    return rows


def output_rows(launches: int, repeats: int) -> dict[str, list[float]]:
    """The same custom kernel (its first output the next launch's input) writing 1, 4, 8 and
    12 outputs, the others 4 floats each (what each output costs a launch: MLX allocates
    and records each; a six-link chain of a Gemma 4 decode step wrote 11, most of them read
    only inside it, before its rows went into one)."""
    rows = {}
    x = mx.zeros((1024,), dtype=mx.float32)
    for count in (1, 4, 8, 12):
        names = ["out"] + [f"o{i}" for i in range(1, count)]
        body = "    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;\n" + \
            "    if (i < N) { out[i] = x[i] + 1.0f; }\n" + "".join(
                f"    if (i < 4) {{ {name}[i] = x[i]; }}\n" for name in names[1:])
        kernel = mx.fast.cuda_kernel(name=f"launch_cost_outputs_{count}", input_names=["x"],
                                     output_names=names, source=body)

        def chain(y: mx.array, k=kernel, count=count) -> mx.array:
            for _ in range(launches):
                y = k(inputs=[y], template=[("N", y.size)], grid=(y.size, 1, 1),
                      threadgroup=(256, 1, 1), output_shapes=[y.shape] + [(4,)] * (count - 1),
                      output_dtypes=[y.dtype] * count)[0]
            return y

        rows[f"custom kernel, {count} outputs"] = per_launch_us(chain, launches, repeats, x)
    return rows


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
    rows.update(norm_rows(args.launches, args.repeats))
    rows.update(scalar_rows(args.launches, args.repeats))
    rows.update(input_rows(args.launches, args.repeats))
    rows.update(output_rows(args.launches, args.repeats))
    print(f"time per launch, {args.launches} launches a graph, median of {args.repeats} "
          f"[min - max], and the host's share (until submitted), device "
          f"{mx.default_device()}, mlx {mx.__version__}")
    host = {name: HOST_US[id(times)] for name, times in rows.items()}
    for name, times in rows.items():
        print(f"  {name:34s} {statistics.median(times):7.2f} us  "
              f"[{min(times):.2f} - {max(times):.2f}]   host {statistics.median(host[name]):.2f}")
    folder = Path(os.environ.get("MLX_PTX_CACHE_DIR", "/nonexistent")) / "mlxrunner"
    sizes = {kind: sorted(p.stat().st_size for p in folder.glob(f"*.{kind}"))
             if folder.is_dir() else [] for kind in ("cubin", "fatbin")}
    for kind, found in sizes.items():
        if found:
            print(f"  the core's {kind}s in {folder}: {len(found)}, bytes median "
                  f"{statistics.median(found):.0f}, range {found[0]}-{found[-1]}")
    if args.json:
        args.json.write_text(json.dumps({"launches": args.launches, "rows_us": rows,
                                         "host_us": host, "cubin_bytes": sizes["cubin"],
                                         "fatbin_bytes": sizes["fatbin"]}, indent=1))
        print(f"  wrote {args.json}")


if __name__ == "__main__":
    main()
