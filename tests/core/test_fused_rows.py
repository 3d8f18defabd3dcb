"""An embedding's lookup as the core's CUDA kernel (``mlxrunner.nn.cuda_rows``): its body in
the CPU emulation (16-byte copies and one entry a thread, a table view off 16 bytes, indices
outside the table give zeros), and on a GPU ``mlxrunner.nn.Embedding`` through it equal to
MLX's lookup."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlxrunner.nn as mnn
from mlxrunner.nn import cuda_rows

on_cuda = pytest.mark.skipif(not (hasattr(mx, "cuda") and mx.cuda.is_available()),
                             reason="needs MLX's CUDA backend")
emulated = pytest.mark.skipif(
    not __import__("mlxrunner.testing.cuda_emulation", fromlist=["_"]).emulation_available(),
    reason="needs g++ for the CUDA emulation")


@emulated
@pytest.mark.parametrize("D,aligned", [(40, True), (40, False), (6, True), (600, True),
                                       (2060, True)])
def test_the_rows_kernel_computes_its_math_in_emulation(D, aligned):
    from mlxrunner.testing.cuda_emulation import emulate_kernel

    rng = np.random.default_rng(D)
    V = 11
    store = np.empty(V * D + 1, np.float32)
    table = (store[:-1] if aligned else store[1:]).reshape(V, D)
    table[:] = rng.normal(size=(V, D))
    ids = np.array([3, 0, 10, 3, -1, 11, 7], np.int32)  # -1 and 11: outside the table
    vec = 4 if D % 4 == 0 else 1  # (float32: 16-byte copies where the width allows)
    spans = -(-D // (cuda_rows.THREADS * vec))
    got = emulate_kernel(
        cuda_rows.ROWS_SOURCE, {"table": table, "ids": ids, "count": np.array([V], np.int32)},
        {"out": ((ids.size, D), np.float32)},
        [("T", mx.float32), ("D", D), ("NT", cuda_rows.THREADS)],
        blocks=(spans, ids.size), threads=cuda_rows.THREADS)["out"]
    want = np.stack([table[i] if 0 <= i < V else np.zeros(D, np.float32) for i in ids])
    np.testing.assert_array_equal(got, want)


@on_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_an_embedding_on_the_gpu_is_mlxs_lookup(dtype):
    mx.random.seed(0)
    layer = mnn.Embedding(1000, 136)
    layer.weight = layer.weight.astype(dtype)
    ids = mx.array(np.random.default_rng(1).integers(0, 1000, (2, 37)).astype(np.int32))
    assert cuda_rows.table_rows(layer.weight, ids) is not None  # the kernel serves
    for index in (ids, ids.astype(mx.uint32), ids[:, -1:]):
        got = layer(index)
        assert got.shape == (*index.shape, 136) and got.dtype == dtype
        assert mx.array_equal(got, mx.take(layer.weight, index, axis=0))
