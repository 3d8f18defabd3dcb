"""A table's rows by index on CUDA (an embedding's lookup), as one of the core's kernels.

MLX builds its gather kernel for a dtype and index type the first time a process with an
empty kernel cache needs it, with MLX's own device headers: the largest single wait before
the first token of a fresh machine (7.4 s on an H100 host, ``bench/startup.py``,
``bench/results/2026-12-06k-h100``). The core's kernels build with CUDA's headers alone and
are kept on disk (:mod:`mlxrunner.nn.cuda_build`), and their self-check's reference here is
slices and a concatenation (MLX kernels that come built), not MLX's gather.

A block per (row, span of the row): 16-byte copies where the table and the row width allow,
else one entry a thread. A negative index counts from the table's end, as MLX's ``take``
does; one outside the table gives a row of zeros (MLX's gather reads outside the table's
memory). Gradients flow as through MLX's ``take`` (a custom kernel has no derivative of its
own).
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
import numpy as np

from ..constants import constant
from .cuda_build import CudaKernel, kernel_code, row_span_grid
from .kernels import kernel_allowed, serves

THREADS = 256
#: the most rows one launch takes (the grid's second dimension)
MAX_ROWS = 65535
FLOATS = (mx.bfloat16, mx.float16, mx.float32)
INDICES = (mx.int32, mx.uint32)

# Template constants: T (table dtype), D (row width), NT (threads); count[0]: the table's
# rows. Block (x, y): entries [x * NT * kVec, ...) of output row y.
ROWS_SOURCE = r"""
    constexpr int kVec = (D * sizeof(T)) % 16 == 0 ? 16 / sizeof(T) : 1;
    const size_t row = blockIdx.y;
    const long long rows = static_cast<long long>(count[0]);
    long long id = static_cast<long long>(ids[row]);
    if (id < 0) id += rows;  // (from the end, as MLX's take counts it)
    const bool inside = id >= 0 && id < rows;
    const int j = (blockIdx.x * NT + threadIdx.x) * kVec;
    if (j >= D) return;
    T* to = out + row * D + j;
    if (kVec > 1 && !(reinterpret_cast<size_t>(table) & 15)) {
        uint4 v = {0u, 0u, 0u, 0u};
        if (inside) v = *reinterpret_cast<const uint4*>(table + (size_t)id * D + j);
        *reinterpret_cast<uint4*>(to) = v;
    } else {
        #pragma unroll 1
        for (int k = 0; k < kVec; ++k) to[k] = inside ? table[(size_t)id * D + j + k] : T(0.f);
    }
"""

_kernel = CudaKernel(name="mlxrunner_rows", input_names=["table", "ids", "count"],
                     output_names=["out"], source=ROWS_SOURCE)


def table_rows(table: mx.array, ids: mx.array) -> mx.array | None:
    """``table[ids]`` (``[*ids.shape, D]``) for a float table ``[V, D]`` and int32 or
    uint32 ``ids``, as the core's kernel on CUDA; None where it does not serve (the caller
    takes MLX's)."""
    if not kernel_allowed("embeddings") or table.ndim != 2 \
            or table.dtype not in FLOATS or ids.dtype not in INDICES \
            or not 0 < ids.size <= MAX_ROWS:
        return None
    D = table.shape[1]
    if not _serves(table.dtype, ids.dtype, D):
        return None
    return cast(mx.array, _rows(table, ids)).reshape(*ids.shape, D)


@mx.custom_function
def _rows(table: mx.array, ids: mx.array) -> mx.array:
    return _launch(table, ids)


@_rows.vjp
def _rows_vjp(primals: Any, cotangent: mx.array, output: mx.array) -> tuple[mx.array, ...]:
    table, ids = primals
    _, (grad,) = mx.vjp(lambda t: mx.take(t, ids.reshape(-1), axis=0), [table], [cotangent])
    return grad, mx.zeros_like(ids)


def _launch(table: mx.array, ids: mx.array) -> mx.array:
    V, D = table.shape
    return _kernel(inputs=[table, ids.reshape(-1), constant((V,), mx.int32)],
                   template=[("T", table.dtype), ("D", D), ("NT", THREADS)],
                   grid=row_span_grid(D, table.dtype, ids.size, THREADS),
                   threadgroup=(THREADS, 1, 1),
                   output_shapes=[(ids.size, D)], output_dtypes=[table.dtype])[0]


def _serves(dtype: mx.Dtype, index: mx.Dtype, D: int) -> bool:
    rows = 64

    def probe() -> tuple[mx.array, list[int]]:
        # (a table of the case's width; host-made indices, one past the table's end: zeros)
        table = mx.random.normal((rows, D), key=mx.random.key(4711)).astype(dtype)
        picks = [int(i) for i in np.random.default_rng(D).integers(0, rows, 7)]
        return table, picks

    def kernel(p: tuple[mx.array, list[int]]) -> Any:
        table, picks = p
        return _launch(table, mx.array(picks + [rows], dtype=index))

    def reference(p: tuple[mx.array, list[int]]) -> Any:
        table, picks = p  # slices and a concatenation: no gather to build
        return mx.concatenate([table[i:i + 1] for i in picks]
                              + [mx.zeros((1, D), dtype)], axis=0)

    return serves("embeddings", (dtype, index, D), kernel, reference, probe, 0.0,
                  source=kernel_code(__file__))
