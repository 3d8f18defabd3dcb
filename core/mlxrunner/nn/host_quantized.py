"""Products with quantized weights on the host, read as they lie in MLX's arrays.

Where products run on the host (:func:`mlxrunner.nn.kernels.host_products`), inside the core's
forwards for generation (:func:`mlxrunner.nn.host_ops.hosting`), a 4- or 8-bit
affine-quantized layer's products of a few rows (a decode step, a verify block, a small
batch) run through the core's C loops (:mod:`mlxrunner.nn.host_build`): float32 activations
against the quantized words, so a step reads the weights' bytes (the default model: 98 MB)
rather than float32 copies (540 MB) through numpy's BLAS; longer products (a prompt)
dequantize the weight, a block of output rows at a time, for the BLAS. MLX's own CPU loops
for these products are several times slower than either (bench/cpu_products.py). Like every
kernel of the core, the first product of a case is checked against MLX's
(:func:`mlxrunner.nn.kernels.serves`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from .host_build import KERNEL_MAX_ROWS, SOURCE, HostKernels, host_kernels
from .host_ops import host_active
from .kernels import HOST_PRODUCT_TOLERANCE, code_of, note_declined, note_host_run, serves

#: the attribute a quantized layer holds its host arrays under: (MLX sources, numpy views)
_HELD = "_mlxrunner_host_quantized"


def host_quantized_product(layer: Any, x: mx.array) -> mx.array | None:
    """``x`` times the transposed weights of quantized layer ``layer`` (no bias) on the host,
    or None where this does not apply: not a host product (the caller checked
    :func:`mlxrunner.nn.kernels.host_eligible`), outside :func:`mlxrunner.nn.host_ops.hosting`
    (no gradient flows through it), a mode or width the kernel does not take, traced
    arrays, no library, or its check failed for this case."""
    bits, group = int(layer.bits), int(layer.group_size)
    if (not host_active() or getattr(layer, "mode", "affine") != "affine"
            or bits not in (4, 8) or group % 32 or "biases" not in layer):
        return None
    weight = layer["weight"]
    in_dims = weight.shape[1] * 32 // bits
    if in_dims % group:
        return None
    kernels = host_kernels()
    if kernels is None:
        return None
    rows = x.size // in_dims
    try:
        x_host = np.ascontiguousarray(np.asarray(x, dtype=np.float32).reshape(rows, in_dims))
        arrays = _host_arrays(layer)
    except ValueError:  # "[eval] ... not allowed" while tracing
        note_declined(rows * in_dims * weight.shape[0])
        return None
    if not _serves(kernels, bits, group, in_dims):
        return None
    y = kernels.product(x_host, *arrays, group_size=group, bits=bits)
    note_host_run(in_dims * weight.shape[0])
    # shaped before it becomes an MLX array: a reshape there is an operation to wait for
    return mx.array(y.reshape(*x.shape[:-1], weight.shape[0]))


def _host_arrays(layer: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Numpy views of the layer's words and float32 copies of its scales and biases, kept
    on the layer while its arrays are the same objects."""
    sources = (layer["weight"], layer["scales"], layer["biases"])
    held = layer.__dict__.get(_HELD)
    if held is not None and all(a is b for a, b in zip(held[0], sources)):
        return held[1]
    weight = np.ascontiguousarray(np.asarray(sources[0]))
    scales = np.ascontiguousarray(np.asarray(sources[1].astype(mx.float32)))
    biases = np.ascontiguousarray(np.asarray(sources[2].astype(mx.float32)))
    arrays = (weight, scales, biases)
    object.__setattr__(layer, _HELD, (sources, arrays))
    return arrays


#: output rows of a check's probe weight (the kernel's work per output row does not depend
#: on their number)
_PROBE_OUT = 96


def _serves(kernels: HostKernels, bits: int, group: int, in_dims: int) -> bool:
    def probe() -> tuple[mx.array, mx.array, mx.array, mx.array]:
        key = mx.random.key(in_dims * 131 + group * 7 + bits)
        kx, kw = mx.random.split(key)
        w = mx.random.uniform(-1, 1, (_PROBE_OUT, in_dims), key=kw)
        q, s, b = mx.quantize(w, group_size=group, bits=bits)
        # one row, a row block and a row past it, and a prompt's length (the BLAS route)
        return mx.random.uniform(-1, 1, (KERNEL_MAX_ROWS + 4, in_dims), key=kx), q, s, b

    def ours(p: tuple[mx.array, ...]) -> list[mx.array]:
        x, q, s, b = (np.asarray(a) for a in p)
        arrays = (np.ascontiguousarray(q), np.ascontiguousarray(s), np.ascontiguousarray(b))
        return [mx.array(kernels.product(np.ascontiguousarray(x[:n]), *arrays,
                                         group_size=group, bits=bits))
                for n in (1, 5, KERNEL_MAX_ROWS + 4)]

    def reference(p: tuple[mx.array, ...]) -> list[mx.array]:
        x, q, s, b = p
        w = mx.dequantize(q, s, b, group_size=group, bits=bits)
        return [x[:n] @ w.T for n in (1, 5, KERNEL_MAX_ROWS + 4)]

    return serves("host quantized product", (bits, group, in_dims, kernels.path), ours,
                  reference, probe, HOST_PRODUCT_TOLERANCE, against="MLX's product",
                  label="mlxrunner: host quantized product", source=code_of(str(SOURCE)))
