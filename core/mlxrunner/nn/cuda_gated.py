"""A gated MLP's activation on CUDA for a prompt's rows: ``act(gate) * up`` read from the one
product that made ``[gate | up]``, as one of the core's kernels.

MLX fuses ``silu(gate) * up`` (``mlxrunner.nn.silu_mul``, compiled) into a kernel it builds
the first time a process with an empty kernel cache runs it, with its own device headers:
6.8 s before a fresh machine's first token on an H100 host (``bench/startup.py``,
``bench/results/2026-12-06k-h100``), one build per activation and dtype. The core's kernels
build with CUDA's headers alone and are kept on disk (:mod:`mlxrunner.nn.cuda_build`); this
one's self-check compares with MLX's operations one at a time (kernels MLX ships built).
Rounded where MLX's operations round (each step of the silu; the GELU in float32, rounded
once), as the fused products' activations are (:mod:`mlxrunner.nn.cuda_products`). A decode
step's activation runs in its product's launch where that product is fused (plain weights);
other MLPs' (biases, quantized weights) come here. Gradients flow as through MLX's
operations (a custom kernel has no derivative of its own).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .cuda_build import CudaKernel, kernel_code, row_span_grid
from .kernels import kernel_allowed, serves

THREADS = 256
#: the most rows one launch takes (the grid's second dimension)
MAX_ROWS = 65535
FLOATS = (mx.bfloat16, mx.float16, mx.float32)
#: the gated activations (``mlxrunner.nn.ACTIVATIONS``' names), as the kernels number them
GLU = {"silu": 1, "gelu_tanh": 2}

# act(g) * u for GLU 1 (silu, each step rounded as MLX's sigmoid and multiply round) or 2
# (gelu_tanh in float32, rounded once), g the gate's value as a float; the fused products'
# activation too (mlxrunner.nn.cuda_products).
GATED_ACTIVATION = r"""
    const auto gated = [](float g, T u) {
        T act;
        if (GLU == 1) {
            const T sig = static_cast<T>(1.f / (1.f + expf(-g)));
            act = static_cast<T>(g * static_cast<float>(sig));
        } else {
            act = static_cast<T>(0.5f * g * (1.f + tanhf(0.7978845608028654f *
                                                          (g + 0.044715f * g * g * g))));
        }
        return static_cast<T>(static_cast<float>(act) * static_cast<float>(u));
    };
"""

# Template constants: T, N (outputs a row: y's rows hold 2N, gate then up), GLU (1: silu,
# 2: gelu_tanh), NT. Block (x, y): entries [x * NT * kVec, ...) of output row y.
GATED_SOURCE = GATED_ACTIVATION + r"""
    constexpr int kVec = (N * sizeof(T)) % 16 == 0 ? 16 / sizeof(T) : 1;
    const int j = (blockIdx.x * NT + threadIdx.x) * kVec;
    if (j >= N) return;
    const size_t row = blockIdx.y;
    const T* g = y + row * 2 * N + j;
    const T* u = g + N;
    T* to = out + row * N + j;
    #pragma unroll
    for (int k = 0; k < kVec; ++k) to[k] = gated(static_cast<float>(g[k]), u[k]);
"""

_kernel = CudaKernel(name="mlxrunner_gated", input_names=["y"], output_names=["out"],
                     source=GATED_SOURCE)


def gated_rows(joined: mx.array, activation: str) -> mx.array | None:
    """``act(gate) * up`` for ``joined = [gate | up]`` (``[..., 2N]``, one product's
    output), ``activation`` ``silu`` or ``gelu_tanh``, as the core's kernel on CUDA; None
    where it does not serve (the caller takes MLX's)."""
    glu = GLU.get(activation, 0)
    if not (glu and kernel_allowed("products")) or joined.dtype not in FLOATS \
            or joined.ndim == 0 or joined.shape[-1] % 2 or joined.shape[-1] == 0:
        return None
    N = joined.shape[-1] // 2
    rows = joined.size // (2 * N)
    if not 0 < rows <= MAX_ROWS or not _serves(joined.dtype, N, glu):
        return None
    return _GATED[glu](joined).reshape(*joined.shape[:-1], N)


def _reference(y: mx.array, glu: int) -> mx.array:
    """What MLX's operations compute (the check's reference, and the derivative's)."""
    from .mlp import _gelu_tanh_mul, _silu_mul  # (mlp imports this module)

    N = y.shape[-1] // 2
    return (_silu_mul if glu == 1 else _gelu_tanh_mul)(y[..., :N], y[..., N:])


def _differentiable(glu: int) -> Any:
    @mx.custom_function
    def gated(y: mx.array) -> mx.array:
        return _launch(y, y.shape[-1] // 2, glu)

    @gated.vjp
    def gated_vjp(primals: Any, cotangent: mx.array, output: mx.array) -> tuple[mx.array]:
        # (MLX hands a one-argument function's primal as the array itself)
        y = primals[0] if isinstance(primals, (list, tuple)) else primals
        _, (grad,) = mx.vjp(lambda v: _reference(v.reshape(-1, v.shape[-1]), glu), [y],
                            [cotangent])
        return (grad,)

    return gated


_GATED = {glu: _differentiable(glu) for glu in GLU.values()}


def _launch(joined: mx.array, N: int, glu: int) -> mx.array:
    rows = joined.size // (2 * N)
    return _kernel(inputs=[joined], template=[("T", joined.dtype), ("N", N), ("GLU", glu),
                                              ("NT", THREADS)],
                   grid=row_span_grid(N, joined.dtype, rows, THREADS),
                   threadgroup=(THREADS, 1, 1),
                   output_shapes=[(rows, N)], output_dtypes=[joined.dtype])[0]


def _serves(dtype: mx.Dtype, N: int, glu: int) -> bool:
    def probe() -> mx.array:
        return (2 * mx.random.normal((3, 2 * N), key=mx.random.key(4712))).astype(dtype)

    def kernel(y: mx.array) -> Any:
        return _launch(y, N, glu)

    def reference(y: mx.array) -> Any:
        return _reference(y, glu)

    return serves("products", ("gated", dtype, N, glu), kernel, reference, probe,
                  2e-3 if dtype == mx.float32 else 3e-2, source=kernel_code(__file__))
