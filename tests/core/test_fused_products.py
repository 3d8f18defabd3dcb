"""mlxrunner.nn.cuda_products: a decode step's products with the RMS norm before them, the
residual after them or a gated MLP's activation fused in, against MLX's operations (the
kernel cases need MLX's CUDA backend; off it, the layers' results are MLX's own)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlxrunner.nn as mnn
from mlxrunner import settings
from mlxrunner.nn import cuda_products, kernels

on_cuda = pytest.mark.skipif(not (hasattr(mx, "cuda") and mx.cuda.is_available()),
                             reason="needs MLX's CUDA backend")


def _tolerance(dtype: mx.Dtype) -> float:
    return 1e-4 if dtype == mx.float32 else 3e-2


def _close(got: mx.array, want: mx.array, dtype: mx.Dtype) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = _tolerance(dtype) * (1.0 + float(mx.abs(want.astype(mx.float32)).max()))
    np.testing.assert_allclose(np.array(got.astype(mx.float32)),
                               np.array(want.astype(mx.float32)), rtol=0, atol=tol)


def test_off_cuda_nothing_is_fused_and_layers_compute_mlx_results():
    if kernels.on_cuda():
        pytest.skip("on CUDA the kernels serve")
    mx.random.seed(0)
    x = mx.random.normal((1, 1, 64))
    w = mx.random.normal((96, 64)) * 0.1
    assert cuda_products.fused_product(x, w) is None
    norm = mnn.RMSNorm(64, 1e-5)
    normed = norm(x)
    assert cuda_products._norm_of(normed) is None  # nothing noted off CUDA
    mlp = mnn.GatedMLP(64, 48)
    got = mlp(normed, x)
    gate, up = normed @ mlp.gate_proj.weight.T, normed @ mlp.up_proj.weight.T
    want = x + (mnn.silu_mul(gate, up) @ mlp.down_proj.weight.T)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


@on_cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("K,N", [(2048, 2560), (576, 1536), (8192, 2048)])
def test_products_match_mlx_operations_on_the_gpu(dtype, rows, K, N):
    mx.set_default_device(mx.gpu)
    keys = [mx.random.key(K + N + i) for i in range(4)]
    x = mx.random.normal((rows, 1, K), key=keys[0]).astype(dtype)
    w = (mx.random.normal((N, K), key=keys[1]) * K ** -0.5).astype(dtype)
    res = mx.random.normal((rows, 1, N), key=keys[2]).astype(dtype)
    nw = (1 + 0.1 * mx.random.normal((K,), key=keys[3])).astype(dtype)
    if rows * K * x.dtype.size > cuda_products.STAGED_BYTES:
        assert cuda_products.fused_product(x, w) is None  # too many rows to stage
        return
    cases = {"plain": (None, 0, None), "residual": (res, 0, None),
             "norm": (None, 0, (x, nw, 1e-5)), "silu": (None, 1, (x, nw, 1e-6)),
             "gelu": (None, 2, None)}
    for name, (r, glu, norm) in cases.items():
        got = cuda_products._launch(x, w, r, glu, norm)
        want = cuda_products._reference(x, w, r, glu, norm)
        _close(got, want, dtype)
        assert cuda_products._serves(x, w, r is not None, glu, norm is not None), name


@on_cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_norm_fuses_into_the_products_that_read_it_on_the_gpu(dtype):
    """RMSNorm, then linears (q/k/v) and a gated MLP with a residual: fused (the norm's
    operation never runs, one kernel per product), equal to MLX's operations."""
    mx.set_default_device(mx.gpu)
    mx.random.seed(3)
    norm = mnn.RMSNorm(256, 1e-5)
    q, k = mnn.Linear(256, 512, bias=False), mnn.Linear(256, 128, bias=False)
    mlp = mnn.GatedMLP(256, 704)
    for layer in (norm, q, k, mlp):
        layer.set_dtype(dtype)
    norm.weight = (1 + 0.1 * mx.random.normal((256,))).astype(dtype)
    x = mx.random.normal((1, 1, 256)).astype(dtype)

    def fused(x: mx.array) -> list[mx.array]:
        h = norm(x)
        return [*mnn.linears(h, q, k), mlp(h, x)]

    with settings.overridden(kernels=frozenset({"attention", "deltanet", "topk"})):
        want = fused(x)
        mx.eval(want)
    got = fused(x)
    for a, b in zip(got, want):
        _close(a, b, dtype)
    labels = _graph_labels(*got)
    assert "RMSNorm" not in labels and "Matmul" not in labels and "Add" not in labels, labels


def _graph_labels(*outputs: mx.array) -> list[str]:
    import re
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".dot") as dot:
        mx.export_to_dot(dot.name, *outputs)
        return re.findall(r'label ="([^"]+)"', dot.read())


def _reference_np(x, w, nw, res, eps, norm, glu):
    if norm:
        x = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * nw
    y = x @ w.T
    if glu:
        gate, up = np.split(y, 2, axis=-1)
        act = gate / (1 + np.exp(-gate)) if glu == 1 else 0.5 * gate * (
            1 + np.tanh(0.7978845608028654 * (gate + 0.044715 * gate ** 3)))
        y = act * up
    return y if res is None else y + res


@pytest.mark.skipif(not __import__("mlxrunner.testing.cuda_emulation", fromlist=["_"])
                    .emulation_available(), reason="needs g++ for the CUDA emulation")
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("aligned", [True, False])
def test_the_product_kernel_computes_its_math_in_emulation(rows, aligned):
    """The kernel's body on the CPU (float32; mlxrunner.testing.cuda_emulation): every
    fused form, rows not a whole number of warps' outputs, a weight view off 16 bytes."""
    from mlxrunner.testing.cuda_emulation import emulate_kernel

    rng = np.random.default_rng(rows)
    K, N, threads = 96, 40, 256
    x = rng.normal(size=(rows, K)).astype(np.float32)
    nw = (1 + 0.1 * rng.normal(size=K)).astype(np.float32)
    eps = np.array([1e-5], np.float32)
    for norm, res, glu in ((False, False, 0), (False, True, 0), (True, False, 0),
                           (True, False, 1), (False, True, 2)):
        n_rows = N * (2 if glu else 1)
        store = np.empty(n_rows * K + 1, np.float32)
        w = (store[:-1] if aligned else store[1:]).reshape(n_rows, K)
        w[:] = rng.normal(size=(n_rows, K)) * K ** -0.5
        r = rng.normal(size=(rows, N)).astype(np.float32)
        got = emulate_kernel(
            cuda_products.PRODUCT_SOURCE,
            {"x": x, "w": w, "nw": nw, "res": r if res else np.zeros(1, np.float32),
             "up_x": np.zeros(1, np.float32), "eps": eps}, {"y": ((rows, N), np.float32)},
            [("T", mx.float32), ("K", K), ("N", N), ("M", rows), ("NT", threads),
             ("NORM", norm), ("RES", res), ("GLU", glu), ("UPX", False)],
            blocks=-(-N // (threads // 32)), threads=threads)["y"]
        want = _reference_np(x, w, nw, r if res else None, 1e-5, norm, glu)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5,
                                   err_msg=f"norm={norm} res={res} glu={glu}")


@pytest.mark.skipif(not __import__("mlxrunner.testing.cuda_emulation", fromlist=["_"])
                    .emulation_available(), reason="needs g++ for the CUDA emulation")
@pytest.mark.parametrize("glu", [1, 2])
def test_a_gate_product_times_a_given_up_computes_its_math_in_emulation(glu):
    """``act(rms_norm(x) @ Wg.T) * up`` with ``up`` an input (a per-layer input, not the
    weight's up rows): the weight has N rows."""
    from mlxrunner.testing.cuda_emulation import emulate_kernel

    rng = np.random.default_rng(glu)
    rows, K, N, threads = 2, 64, 24, 256
    x = rng.normal(size=(rows, K)).astype(np.float32)
    w = (rng.normal(size=(N, K)) * K ** -0.5).astype(np.float32)
    nw = (1 + 0.1 * rng.normal(size=K)).astype(np.float32)
    up = rng.normal(size=(rows, N)).astype(np.float32)
    got = emulate_kernel(
        cuda_products.PRODUCT_SOURCE,
        {"x": x, "w": w, "nw": nw, "res": np.zeros(1, np.float32), "up_x": up,
         "eps": np.array([1e-6], np.float32)}, {"y": ((rows, N), np.float32)},
        [("T", mx.float32), ("K", K), ("N", N), ("M", rows), ("NT", threads),
         ("NORM", True), ("RES", False), ("GLU", glu), ("UPX", True)],
        blocks=-(-N // (threads // 32)), threads=threads)["y"]
    gate = _reference_np(x, w, nw, None, 1e-6, True, 0)
    act = gate / (1 + np.exp(-gate)) if glu == 1 else 0.5 * gate * (
        1 + np.tanh(0.7978845608028654 * (gate + 0.044715 * gate ** 3)))
    np.testing.assert_allclose(got, act * up, rtol=1e-5, atol=1e-5)
