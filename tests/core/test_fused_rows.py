"""An embedding's lookup as the core's CUDA kernel (``mlxrunner.nn.cuda_rows``): its body in
the CPU emulation (16-byte copies and one entry a thread, negative indices from the end,
indices outside the table give zeros), its derivative (MLX's take's), and on a GPU
``mlxrunner.nn.Embedding`` through it (no gather in its graph) equal to MLX's lookup, a
table off 16-byte alignment included."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlxrunner.nn as mnn
from mlxrunner.nn import cuda_rows
from mlxrunner_test_support import graph_labels, on_cuda_and_emulated

on_cuda, emulated = on_cuda_and_emulated()


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
    ids = np.array([3, 0, 10, 3, -1, 11, 7, -12], np.int32)  # -1: the last; 11, -12: outside
    vec = 4 if D % 4 == 0 else 1  # (float32: 16-byte copies where the width allows)
    spans = -(-D // (cuda_rows.THREADS * vec))
    assert cuda_rows.row_span_grid(D, mx.float32, ids.size, cuda_rows.THREADS) \
        == (cuda_rows.THREADS * spans, ids.size, 1)  # (the launch's grid)
    got = emulate_kernel(
        cuda_rows.ROWS_SOURCE, {"table": table, "ids": ids, "count": np.array([V], np.int32)},
        {"out": ((ids.size, D), np.float32)},
        [("T", mx.float32), ("D", D), ("NT", cuda_rows.THREADS)],
        blocks=(spans, ids.size), threads=cuda_rows.THREADS)["out"]
    want = np.stack([table[i] if -V <= i < V else np.zeros(D, np.float32) for i in ids])
    np.testing.assert_array_equal(got, want)


@on_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_an_embedding_on_the_gpu_is_mlxs_lookup(dtype):
    mx.set_default_device(mx.gpu)
    mx.random.seed(0)
    layer = mnn.Embedding(1000, 136)
    layer.weight = layer.weight.astype(dtype)
    ids = mx.array(np.random.default_rng(1).integers(0, 1000, (2, 37)).astype(np.int32))
    for index in (ids, ids.astype(mx.uint32), ids[:, -1:]):
        got = layer(index)
        labels = graph_labels(got)
        assert "CustomKernel" in labels and "Gather" not in labels  # the core's kernel ran
        assert got.shape == (*index.shape, 136) and got.dtype == dtype
        assert mx.array_equal(got, mx.take(layer.weight, index, axis=0))
    # a table whose rows start off 16-byte alignment: the copies one entry at a time
    store = mx.random.normal((1000 * 136 + 1,)).astype(dtype)
    mx.eval(store)
    layer.weight = store[1:].reshape(1000, 136)
    assert mx.array_equal(layer(ids), mx.take(layer.weight, ids, axis=0))


def test_gradients_flow_through_the_kernel_as_through_mlxs_take(monkeypatch):
    """A custom kernel has no derivative: the lookup's is MLX's take's (the launch stood in
    for by MLX's take here, the kernel path forced on)."""
    monkeypatch.setattr(cuda_rows, "kernel_allowed", lambda name: True)
    monkeypatch.setattr(cuda_rows, "serves", lambda *args, **kwargs: True)
    launched = []

    def launch(table, ids):
        launched.append(ids.size)
        return mx.take(table, ids.reshape(-1), axis=0)

    monkeypatch.setattr(cuda_rows, "_launch", launch)
    mx.random.seed(0)
    layer = mnn.Embedding(50, 8)
    ids = mx.array([[3, 7, 3], [49, 0, 7]])
    target = mx.random.normal((2, 3, 8))

    def loss(weight):
        layer.weight = weight
        return ((layer(ids) - target) ** 2).sum()

    got = mx.grad(loss)(layer.weight)
    assert launched  # the kernel's path ran
    want = mx.grad(lambda w: ((mx.take(w, ids, axis=0) - target) ** 2).sum())(layer.weight)
    assert mx.allclose(got, want) and float(mx.abs(got).sum()) > 0
