"""A prompt's gated activation as the core's CUDA kernel (``mlxrunner.nn.cuda_gated``): its
body in the CPU emulation against numpy (silu rounded each step, gelu_tanh in float32; 16-byte
steps and one entry a thread), and on a GPU a ``GatedMLP`` over a prompt equal to MLX's
operations."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

import mlxrunner.nn as mnn
from mlxrunner.nn import cuda_gated
from mlxrunner_test_support import graph_labels, on_cuda_and_emulated

on_cuda, emulated = on_cuda_and_emulated()


@emulated
@pytest.mark.parametrize("N,glu", [(40, 1), (40, 2), (6, 1), (2060, 2)])
def test_the_gated_kernel_computes_its_math_in_emulation(N, glu):
    from mlxrunner.testing.cuda_emulation import emulate_kernel

    rows = 5
    y = (2 * np.random.default_rng(N + glu).normal(size=(rows, 2 * N))).astype(np.float32)
    vec = 4 if N % 4 == 0 else 1
    spans = -(-N // (cuda_gated.THREADS * vec))
    assert cuda_gated.row_span_grid(N, mx.float32, rows, cuda_gated.THREADS) \
        == (cuda_gated.THREADS * spans, rows, 1)  # (the launch's grid)
    got = emulate_kernel(
        cuda_gated.GATED_SOURCE, {"y": y}, {"out": ((rows, N), np.float32)},
        [("T", mx.float32), ("N", N), ("GLU", glu), ("NT", cuda_gated.THREADS)],
        blocks=(spans, rows), threads=cuda_gated.THREADS)["out"]
    g, u = y[:, :N].astype(np.float64), y[:, N:]
    act = g / (1 + np.exp(-g)) if glu == 1 else \
        0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))
    np.testing.assert_allclose(got, act * u, rtol=1e-5, atol=1e-5)


@on_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_a_prompts_gated_mlp_on_the_gpu_is_mlxs(dtype, activation):
    mx.set_default_device(mx.gpu)
    mx.random.seed(0)
    mlp = mnn.GatedMLP(64, 136, activation)
    mlp.set_dtype(dtype)
    x = mx.random.normal((2, 33, 64)).astype(dtype)  # a prompt's rows
    y = mx.concatenate([x @ mlp.gate_proj.weight.T, x @ mlp.up_proj.weight.T], axis=-1)
    name = "silu" if activation == "silu" else "gelu_tanh"
    assert cuda_gated.gated_rows(y, name) is not None  # the kernel serves
    gate, up = x @ mlp.gate_proj.weight.T, x @ mlp.up_proj.weight.T
    act = mnn.silu_mul if activation == "silu" else mnn.gelu_tanh_mul
    want = act(gate, up) @ mlp.down_proj.weight.T
    tolerance = 1e-4 if dtype == mx.float32 else 3e-2
    got = mlp(x)
    assert "CustomKernel" in graph_labels(got)  # the core's kernel ran (MLX's is a Compiled)
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32),
                       rtol=tolerance, atol=tolerance)


def test_gradients_flow_through_the_kernel_as_through_mlxs_operations(monkeypatch):
    """A custom kernel has no derivative: the activation's is MLX's operations' (the launch
    stood in for by them here, the kernel path forced on)."""
    monkeypatch.setattr(cuda_gated, "kernel_allowed", lambda name: True)
    monkeypatch.setattr(cuda_gated, "serves", lambda *args, **kwargs: True)
    launched = []

    def launch(y, N, glu):
        launched.append(glu)
        return mnn.silu_mul(y[..., :N], y[..., N:]).reshape(-1, N)

    monkeypatch.setattr(cuda_gated, "_launch", launch)
    mx.random.seed(1)
    mlp = mnn.GatedMLP(16, 24)
    x = mx.random.normal((1, 9, 16))

    def loss(x):
        return (mlp(x) ** 2).sum()

    got = mx.grad(loss)(x)
    assert launched == [1]  # the kernel's path ran
    monkeypatch.setattr(cuda_gated, "kernel_allowed", lambda name: False)
    want = mx.grad(loss)(x)
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-5) and float(mx.abs(got).sum()) > 0
