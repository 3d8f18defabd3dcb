"""mlxrunner.nn.cuda_products: a decode step's products with the residual after them, a gated
MLP's activation or a post norm's residual add fused in, against MLX's operations (the
kernel cases need MLX's CUDA backend; off it, the layers' results are MLX's own)."""

from __future__ import annotations

from contextlib import nullcontext

import mlx.core as mx
import numpy as np
import pytest

import mlxrunner.nn as mnn
from mlxrunner import settings
from mlxrunner.constants import compiling
from mlxrunner.nn import cuda_build, cuda_products, kernels
from mlxrunner_test_support import graph_labels, on_cuda_and_emulated, read_as_one

on_cuda, emulated = on_cuda_and_emulated()


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
    normed = mnn.RMSNorm(64, 1e-5)(x)
    mlp = mnn.GatedMLP(64, 48)
    got = mlp(normed, x)
    gate, up = normed @ mlp.gate_proj.weight.T, normed @ mlp.up_proj.weight.T
    want = x + (mnn.silu_mul(gate, up) @ mlp.down_proj.weight.T)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


def test_a_post_norm_add_relaunches_the_product_that_made_its_input(monkeypatch):
    """add_normed(residual, y) where y is a fused product's output: the product launched
    again with the post norm's residual add after it (the kernel stood in for by MLX's
    operations here), the first launch left without a reader; any other y takes the
    add-norm kernel's path."""
    launches = []

    def stand_in(x, w, res, glu, up=None, post=None):
        launches.append(post is not None)
        return cuda_products._reference(x, w, res, glu, up, post)

    probed = []

    def checked(name, case, kernel, reference, probe, tolerance, **kwargs):  # the check's
        inputs = probe()  # inputs built and passed as the real check passes them
        np.testing.assert_allclose(np.array(kernel(inputs)), np.array(reference(inputs)))
        probed.append(case)
        return True

    monkeypatch.setattr(cuda_products, "kernel_allowed", lambda name: True)
    monkeypatch.setattr(cuda_products, "serves", checked)
    monkeypatch.setattr(cuda_products, "_launch", stand_in)
    mx.random.seed(4)
    x, w = mx.random.normal((1, 1, 64)), mx.random.normal((96, 64)) * 0.1
    r, s = mx.random.normal((1, 1, 96)), mx.array([0.5])
    post = mnn.RMSNorm(96, 1e-6)
    post.weight = 1 + 0.1 * mx.random.normal((96,))
    y = cuda_products.fused_product(x, w)
    assert y is not None and launches == [False, False]  # the check's launch, then its own
    got = post.add_normed(r, y, s)
    assert launches == [False, False, True, True]
    assert probed[-1][-2:] == ("post", 2)  # checked as a case of its own
    want = (r + mx.fast.rms_norm(x @ w.T, post.weight, 1e-6)) * s
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)
    assert cuda_products.fused_add_normed(r, x @ w.T, post.weight, 1e-6, s) is None
    assert cuda_products.fused_add_normed(r[..., :48], y, post.weight, 1e-6, s) is None


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
    cases = {"plain": (None, 0), "residual": (res, 0), "silu": (None, 1), "gelu": (None, 2)}
    for name, (r, glu) in cases.items():
        got = cuda_products._launch(x, w, r, glu)
        want = cuda_products._reference(x, w, r, glu)
        _close(got, want, dtype)
        assert cuda_products._serves(x, w, r is not None, glu), name


@on_cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_norm_before_products_is_mlxs_and_the_products_fuse_on_the_gpu(dtype):
    """RMSNorm, then linears (q/k/v) and a gated MLP with a residual: MLX's norm, then one
    kernel per product (no separate product, activation or add), equal to MLX's
    operations."""
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
    labels = graph_labels(*got)  # before an evaluation detaches the graph
    for a, b in zip(got, want):
        _close(a, b, dtype)
    assert "RMSNorm" in labels and "Matmul" not in labels and "Add" not in labels, labels


@on_cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
def test_a_post_norm_add_runs_in_its_products_launch_on_the_gpu(dtype, rows):
    """``post_norm.add_normed(residual, o_proj(x), scale)``: the post norm's residual add
    in the product's own launch (its last block), equal to MLX's operations, one kernel,
    again and again (the block counter is back at 0 after each launch)."""
    mx.set_default_device(mx.gpu)
    mx.random.seed(5)
    o_proj, post = mnn.Linear(512, 1536, bias=False), mnn.RMSNorm(1536, 1e-6)
    o_proj.set_dtype(dtype)
    post.weight = (1 + 0.1 * mx.random.normal((1536,))).astype(dtype)
    scale = mx.array([0.7], dtype=dtype)
    for _ in range(3):
        x = mx.random.normal((rows, 1, 512)).astype(dtype)
        r = mx.random.normal((rows, 1, 1536)).astype(dtype)
        mx.eval(x, r)
        for s in (None, scale):
            with settings.overridden(kernels=frozenset({"attention", "deltanet", "topk"})):
                want = post.add_normed(r, o_proj(x), s)
                mx.eval(want)
            got = post.add_normed(r, o_proj(x), s)
            views = {"Reshape", "Broadcast", "Slice", "Transpose", "Squeeze", "ExpandDims"}
            kernels_run = [label for label in graph_labels(got) if label not in views]
            # the product's launch, and the fill of its block counter (made lazily outside
            # a trace: see cuda_build.block_counters)
            assert sorted(kernels_run) == ["CustomKernel", "Full"], kernels_run
            _close(got, want, dtype)
    # two launches of one product with independent inputs, evaluated together (as a
    # traced step and the eager step that checks it): each counts its own blocks
    xs = [mx.random.normal((rows, 1, 512)).astype(dtype) for _ in range(2)]
    mx.eval(xs)
    with settings.overridden(kernels=frozenset({"attention", "deltanet", "topk"})):
        want = [post.add_normed(r, o_proj(x), scale) for x in xs]
        mx.eval(want)
    for _ in range(3):
        got = [post.add_normed(r, o_proj(x), scale) for x in xs]
        mx.eval(got)
        for a, b in zip(got, want):
            _close(a, b, dtype)


@on_cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
def test_a_pre_norm_runs_in_the_launch_before_it_on_the_gpu(dtype, rows):
    """Two pre-norm blocks (``h = x + o(a)``, ``mlp(norm(h), h)``, then ``norm(h)`` again)
    and a post-norm block (``add_normed``, then a pre-norm, then ``add_normed`` on the
    residual): every norm written by the launch before it, no norm kernel and no launch
    that no one reads, equal to MLX's operations, again and again (the counters)."""
    mx.set_default_device(mx.gpu)
    mx.random.seed(7)
    o_proj, q = mnn.Linear(512, 1536, bias=False), mnn.Linear(1536, 1024, bias=False)
    k = mnn.Linear(1536, 512, bias=False)
    mlp = mnn.GatedMLP(1536, 2048, "gelu_pytorch_tanh")
    pre, pre2, post = (mnn.RMSNorm(1536, 1e-6, offset=1.0), mnn.RMSNorm(1536, 1e-5),
                       mnn.RMSNorm(1536, 1e-6))
    for layer in (o_proj, q, k, mlp, pre, pre2, post):
        layer.set_dtype(dtype)
    pre.weight = (0.1 * mx.random.normal((1536,))).astype(dtype)
    pre2.weight = (1 + 0.1 * mx.random.normal((1536,))).astype(dtype)

    def pre_norm_blocks(x: mx.array, a: mx.array) -> mx.array:
        h = o_proj(a, x)
        h = mlp(pre(h), h)
        return q(pre2(h))

    def post_norm_block(x: mx.array, a: mx.array) -> mx.array:
        h = post.add_normed(x, o_proj(a))
        return post.add_normed(h, o_proj(k(pre(h))), mx.array([0.5], dtype))

    views = {"Reshape", "Broadcast", "Slice", "Transpose", "Squeeze", "ExpandDims"}
    # (traced, one launch each, a chain: pre-norm blocks, o_proj with the norm after it,
    # gate/up, down with the norm after it, q; post-norm, the add-norm launch with the norm
    # after it, k, the add-norm launch: the launches it replaced are read by no one; eager,
    # a launch each, the first add-norm launch read by no one)
    for block, launches, eager_launches in ((pre_norm_blocks, 1, 4), (post_norm_block, 1, 3)):
        for _ in range(3):
            x = mx.random.normal((rows, 1, 1536)).astype(dtype)
            a = mx.random.normal((rows, 1, 512)).astype(dtype)
            mx.eval(x, a)
            with settings.overridden(kernels=frozenset({"attention", "deltanet", "topk"})):
                want = block(x, a)
                mx.eval(want)
            with compiling():  # (built as in a traced step: chained)
                got = block(x, a)
            kernels_run = [label for label in graph_labels(got) if label not in views]
            assert kernels_run == ["CustomKernel"] * launches, kernels_run
            # eager: a launch a product (each a fill of its block counter beside it where
            # a last block finishes its rows: made lazily outside a trace)
            eager = block(x, a)
            kernels_run = [label for label in graph_labels(eager) if label not in views]
            assert kernels_run.count("CustomKernel") == eager_launches, kernels_run
            assert set(kernels_run) <= {"CustomKernel", "Full"}, kernels_run
            _close(eager, want, dtype)
            _close(got, want, dtype)


@on_cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("rows", [1, 2])
def test_a_layers_products_run_as_one_chain_on_the_gpu(dtype, rows):
    """Gemma 4's layer end: the MLP (gate/up, then down with the post norm's add) and the
    per-layer gate times its input, then the projection with a scaled post norm's add and
    the next norm: one launch (a chain of four products), equal to MLX's operations and to
    the four launches run one by one, again and again (the chain's counters back at 0),
    also two of them evaluated at once."""
    mx.set_default_device(mx.gpu)
    mx.random.seed(9)
    hidden, p = 1536, 256
    mlp = mnn.GatedMLP(hidden, 6144, "gelu_pytorch_tanh")
    gate, proj = mnn.Linear(hidden, p, bias=False), mnn.Linear(p, hidden, bias=False)
    post, post2, after = (mnn.RMSNorm(hidden, 1e-6) for _ in range(3))
    for layer in (mlp, gate, proj, post, post2, after):
        layer.set_dtype(dtype)
    for norm in (post, post2, after):
        norm.weight = (1 + 0.1 * mx.random.normal((hidden,))).astype(dtype)
    scale = mx.array([0.6], dtype)

    def layer_end(h: mx.array, normed: mx.array, per_layer: mx.array) -> mx.array:
        h = post.add_normed(h, mlp(normed))
        g = mnn.gelu_tanh_mul(gate(h), per_layer)
        return after(post2.add_normed(h, proj(g), scale))

    views = {"Reshape", "Broadcast", "Slice", "Transpose", "Squeeze", "ExpandDims"}
    all_kernels = frozenset(settings.KERNELS)
    for _ in range(3):
        inputs = [mx.random.normal((rows, 1, n)).astype(dtype) for n in (hidden, hidden, p)]
        mx.eval(inputs)
        with settings.overridden(kernels=frozenset({"attention", "deltanet", "topk"})):
            want = layer_end(*inputs)
            mx.eval(want)
        with settings.overridden(kernels=all_kernels - {"chains"}):
            alone = layer_end(*inputs)
            assert [label for label in graph_labels(alone) if label not in views].count(
                "CustomKernel") == 4
            mx.eval(alone)
        with compiling():  # (built as the core builds a step it traces: chained)
            got = layer_end(*inputs)
        kernels_run = [label for label in graph_labels(got) if label not in views]
        assert kernels_run.count("CustomKernel") == 1, kernels_run
        eager = layer_end(*inputs)  # (an eager call chains nothing)
        assert [label for label in graph_labels(eager) if label not in views].count(
            "CustomKernel") == 4
        _close(eager, want, dtype)
        _close(got, want, dtype)
        np.testing.assert_array_equal(np.array(got.astype(mx.float32)),
                                      np.array(alone.astype(mx.float32)))
    pairs = [[mx.random.normal((rows, 1, n)).astype(dtype) for n in (hidden, hidden, p)]
             for _ in range(2)]
    mx.eval(pairs)
    with settings.overridden(kernels=frozenset({"attention", "deltanet", "topk"})):
        want_pair = [layer_end(*inputs) for inputs in pairs]
        mx.eval(want_pair)
    for _ in range(3):
        with compiling():
            got_pair = [layer_end(*inputs) for inputs in pairs]
        mx.eval(got_pair)
        for a, b in zip(got_pair, want_pair):
            _close(a, b, dtype)


def _reference_np(x, w, res, glu):
    y = x @ w.T
    if glu:
        gate, up = np.split(y, 2, axis=-1)
        act = gate / (1 + np.exp(-gate)) if glu == 1 else 0.5 * gate * (
            1 + np.tanh(0.7978845608028654 * (gate + 0.044715 * gate ** 3)))
        y = act * up
    return y if res is None else y + res


@emulated
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("K", [96, 2176])
def test_the_product_kernel_computes_its_math_in_emulation(rows, aligned, K):
    """The kernel's body on the CPU (float32; mlxrunner.testing.cuda_emulation): every
    fused form, rows not a whole number of warps' outputs, a weight view and rows of x off
    16 bytes (read one entry a load, not 16 bytes); K under one warp's run of inputs, and
    over a run for each of the block's warps (2176: 17 runs of 128, the first warp three)."""
    from mlxrunner.testing.cuda_emulation import emulate_kernel

    rng = np.random.default_rng(rows)
    N, threads = 40, 256
    x_store = np.empty(rows * K + 1, np.float32)
    x = (x_store[:-1] if aligned else x_store[1:]).reshape(rows, K)
    x[:] = rng.normal(size=(rows, K))
    for res, glu in ((False, 0), (True, 0), (False, 1), (True, 2)):
        n_rows = N * (2 if glu else 1)
        store = np.empty(n_rows * K + 1, np.float32)
        w = (store[:-1] if aligned else store[1:]).reshape(n_rows, K)
        w[:] = rng.normal(size=(n_rows, K)) * K ** -0.5
        r = rng.normal(size=(rows, N)).astype(np.float32)
        got = emulate_kernel(
            cuda_products.PRODUCT_SOURCE,
            {"x": x, "w": w, "res": r if res else None, "up_x": None},
            {"y": ((rows, N), np.float32)},
            [("T", mx.float32), ("K", K), ("N", N), ("M", rows), ("NT", threads),
             ("RES", res), ("GLU", glu), ("UPX", False), ("ADDN", False)],
            blocks=-(-N // (threads // 32)), threads=threads)["y"]
        want = _reference_np(x, w, r if res else None, glu)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5,
                                   err_msg=f"res={res} glu={glu}")


@emulated
@pytest.mark.parametrize("glu,res", [(1, False), (2, True), (0, True)])
def test_four_rows_and_a_last_block_past_n_compute_their_math_in_emulation(glu, res):
    """Four rows of x (a verify block) and N = 37 outputs: the last block's rows past N read
    row N - 1 (and its up row) again, unused; nothing past N is written."""
    from mlxrunner.testing.cuda_emulation import emulate_kernel

    rng = np.random.default_rng(glu)
    rows, K, N, threads = 4, 2176, 37, 256
    x = rng.normal(size=(rows, K)).astype(np.float32)
    w = (rng.normal(size=(N * (2 if glu else 1), K)) * K ** -0.5).astype(np.float32)
    r = rng.normal(size=(rows, N)).astype(np.float32)
    got = emulate_kernel(
        cuda_products.PRODUCT_SOURCE, {"x": x, "w": w, "res": r if res else None, "up_x": None},
        {"y": ((rows, N), np.float32)},
        [("T", mx.float32), ("K", K), ("N", N), ("M", rows), ("NT", threads), ("RES", res),
         ("GLU", glu), ("UPX", False), ("ADDN", False)],
        blocks=-(-N // (threads // 32)), threads=threads)["y"]
    np.testing.assert_allclose(got, _reference_np(x, w, r if res else None, glu),
                               rtol=1e-5, atol=1e-5)


@emulated
@pytest.mark.parametrize("rows,scaled", [(1, False), (3, True)])
def test_a_post_norm_add_after_the_product_computes_its_math_in_emulation(rows, scaled):
    """``h = (pres + rms_norm(x @ W.T) * pw) * ps`` by the last block (its count reaching
    the grid), the block counter left at 0; N over several blocks, not a whole number of
    the block's threads."""
    from mlxrunner.testing.cuda_emulation import emulate_kernel

    rng = np.random.default_rng(rows)
    K, N, threads = 64, 300, 256
    x = rng.normal(size=(rows, K)).astype(np.float32)
    w = (rng.normal(size=(N, K)) * K ** -0.5).astype(np.float32)
    pw = (1 + 0.1 * rng.normal(size=N)).astype(np.float32)
    pres = rng.normal(size=(rows, N)).astype(np.float32)
    ps = np.array([0.6], np.float32)
    counter = np.zeros(1, np.int32)
    for _ in range(2):  # the counter is reset for the next launch
        got = emulate_kernel(
            cuda_products.PRODUCT_ADD_NORM_SOURCE,
            {"x": x, "w": w, "res": None, "up_x": None, "pw": pw, "pres": pres,
             "ps": ps if scaled else None,
             "peps": np.array([1e-6], np.float32), "cnt": counter},
            {"y": ((rows, N), np.float32), "h": ((rows, N), np.float32)},
            [("T", mx.float32), ("K", K), ("N", N), ("M", rows), ("NT", threads),
             ("RES", False), ("GLU", 0), ("UPX", False), ("ADDN", True),
             ("PSCALE", scaled)],
            blocks=-(-N // (threads // 32)), threads=threads)
        y = _reference_np(x, w, None, 0)
        np.testing.assert_allclose(got["y"], y, rtol=1e-5, atol=1e-5)
        h = pres + y / np.sqrt((y * y).mean(-1, keepdims=True) + 1e-6) * pw
        np.testing.assert_allclose(got["h"], h * ps if scaled else h, rtol=1e-5, atol=1e-5)
        assert counter[0] == 0


@emulated
@pytest.mark.parametrize("rows,addn", [(1, False), (3, False), (2, True)])
def test_the_norm_after_a_launchs_final_rows_computes_its_math_in_emulation(rows, addn):
    """``hn = rms_norm(f) * nw`` by the last block, ``f`` the residual sum ``x @ W.T + res``
    (``h`` left unwritten) or the post norm's add ``h`` (written as the add-norm kernel
    writes it); the counter back at 0; N over several blocks."""
    from mlxrunner.testing.cuda_emulation import emulate_kernel

    rng = np.random.default_rng(10 + rows)
    K, N, threads = 64, 300, 256
    x = rng.normal(size=(rows, K)).astype(np.float32)
    w = (rng.normal(size=(N, K)) * K ** -0.5).astype(np.float32)
    res = rng.normal(size=(rows, N)).astype(np.float32)
    pw = (1 + 0.1 * rng.normal(size=N)).astype(np.float32)
    pres = rng.normal(size=(rows, N)).astype(np.float32)
    nw = (0.5 + rng.uniform(size=N)).astype(np.float32)
    counter = np.zeros(1, np.int32)
    for _ in range(2):  # the counter is reset for the next launch
        got = emulate_kernel(  # (None: an input the core leaves absent)
            cuda_products.PRODUCT_NORM_SOURCE,
            {"x": x, "w": w, "res": None if addn else res, "up_x": None,
             "pw": pw if addn else None, "pres": pres if addn else None,
             "ps": np.array([0.6], np.float32) if addn else None,
             "peps": np.array([1e-6], np.float32) if addn else None, "cnt": counter,
             "nw": nw, "neps": np.array([1e-5], np.float32)},
            {"y": ((rows, N), np.float32), "h": ((rows, N), np.float32) if addn else None,
             "hn": ((rows, N), np.float32)},
            [("T", mx.float32), ("K", K), ("N", N), ("M", rows), ("NT", threads),
             ("RES", not addn), ("GLU", 0), ("UPX", False), ("ADDN", addn),
             ("PSCALE", addn)],
            blocks=-(-N // (threads // 32)), threads=threads)
        y = _reference_np(x, w, None if addn else res, 0)
        np.testing.assert_allclose(got["y"], y, rtol=1e-5, atol=1e-5)
        final = y
        if addn:
            final = (pres + y / np.sqrt((y * y).mean(-1, keepdims=True) + 1e-6) * pw) * 0.6
            np.testing.assert_allclose(got["h"], final, rtol=1e-5, atol=1e-5)
        else:
            assert "h" not in got  # absent (a null pointer the kernel never touches)
        normed = final / np.sqrt((final * final).mean(-1, keepdims=True) + 1e-5) * nw
        np.testing.assert_allclose(got["hn"], normed, rtol=1e-5, atol=1e-5)
        assert counter[0] == 0


def test_chained_readers_take_the_last_launch_and_a_link_never_reads_its_own_rows(
        monkeypatch):
    """While a step is traced: a product reading a launch's last rows joins it; a second
    product reading the same rows (two input products of one norm) runs alone on the last
    launch's rows, and the stream read later comes from that launch too (one launch read
    for them all, its links stood in for by MLX's operations, one mark a launch); a post
    norm's add whose residual is its own product's rows is not chained. Results are MLX's."""
    def run(links):
        return read_as_one(cuda_products._reference_links(links))

    monkeypatch.setattr(cuda_products, "kernel_allowed", lambda name: True)
    monkeypatch.setattr(cuda_products, "serves", lambda *args, **kwargs: True)
    monkeypatch.setattr(cuda_products, "_run", run)
    mx.random.seed(8)
    o_proj, a, b = (mnn.Linear(32, 64, bias=False), mnn.Linear(64, 48, bias=False),
                    mnn.Linear(64, 16, bias=False))
    norm, post48 = mnn.RMSNorm(64, 1e-5), mnn.RMSNorm(48, 1e-6)
    post48.weight = 1 + 0.1 * mx.random.normal((48,))
    x, r = mx.random.normal((1, 1, 32)), mx.random.normal((1, 1, 64))
    with compiling():
        h = o_proj(x, r)
        hn = norm(h)
        first, second = a(hn), b(hn)
        stream = mnn.residual_stream(h)
        outs = [first, second, stream]
        labels = graph_labels(*outs)
        y = a(norm(o_proj(x, r)))  # (a chain's last link)
        own = post48.add_normed(y, y)
    # the chain, then b alone: o's product read once (not a second chain of o and b)
    assert labels.count("StopGradient") == 2 and labels.count("Matmul") == 3, labels
    want_h = x @ o_proj.weight.T + r
    want_hn = mx.fast.rms_norm(want_h, norm.weight, 1e-5)
    for got, want in zip(outs, [want_hn @ a.weight.T, want_hn @ b.weight.T, want_h]):
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    want_y = want_hn @ a.weight.T
    np.testing.assert_allclose(np.array(own), np.array(
        want_y + mx.fast.rms_norm(want_y, post48.weight, 1e-6)), rtol=1e-5, atol=1e-5)


def test_an_eager_forward_keeps_few_renamed_rows(monkeypatch):
    """Rows a relaunch renamed are remembered per thread: many while a step is traced (its
    arrays hold no data), few after eager forwards, whose arrays hold theirs (each a
    pre-norm's relaunch, the kernels stood in for by MLX's operations)."""
    def normed(x, w, res, post, then):
        y = cuda_products._reference(x, w, res, 0, None, post)
        return y, mx.fast.rms_norm(y, *then)

    monkeypatch.setattr(cuda_products, "kernel_allowed", lambda name: True)
    monkeypatch.setattr(cuda_products, "serves", lambda *args, **kwargs: True)
    monkeypatch.setattr(cuda_products, "_launch", lambda x, w, res, glu, up=None, post=None:
                        cuda_products._reference(x, w, res, glu, up, post))
    monkeypatch.setattr(cuda_products, "_launch_normed", normed)
    # (none remembered yet)
    monkeypatch.setattr(cuda_products, "_noted", type(cuda_products._noted)())
    o_proj, norm = mnn.Linear(32, 64, bias=False), mnn.RMSNorm(64, 1e-5)
    x, r = mx.random.normal((1, 1, 32)), mx.random.normal((1, 1, 64))
    renamed = 0
    for traced in (True, False):
        with compiling() if traced else nullcontext():
            for _ in range(3 * cuda_products.NOTED_ROWS):
                norm(o_proj(x, r))
        renamed = len(cuda_products._noted.renamed)
        limit = cuda_products.NOTED_RENAMED if traced else cuda_products.NOTED_ROWS
        assert renamed == min(3 * cuda_products.NOTED_ROWS, limit), (traced, renamed)


def test_a_norm_of_a_residual_sum_relaunches_its_product_and_readers_take_the_new_rows(
        monkeypatch):
    """RMSNorm(h) where h is a fused residual product's (or a post norm add's) output: the
    product launched again with the norm after it; the next residual reader (a linear's
    residual, add_normed's residual, a tap) takes that launch's h, so the first launch is
    read by no one (the kernels stood in for by MLX's operations here, the relaunch's rows
    marked +1000 to show who reads them); any other input is MLX's norm."""
    launches = []

    def stand_in(x, w, res, glu, up=None, post=None):
        launches.append("post" if post is not None else "res" if res is not None else "plain")
        return cuda_products._reference(x, w, res, glu, up, post)

    def stand_in_normed(x, w, res, post, then):
        launches.append("then")
        y = cuda_products._reference(x, w, res, 0, None, post)
        return y + 1000, mx.fast.rms_norm(y, *then)

    cases = []

    def checked(name, case, kernel, reference, probe, tolerance, **kwargs):
        probe()  # the check's inputs build
        cases.append(case)
        return True

    monkeypatch.setattr(cuda_products, "kernel_allowed", lambda name: True)
    monkeypatch.setattr(cuda_products, "serves", checked)
    monkeypatch.setattr(cuda_products, "_launch", stand_in)
    monkeypatch.setattr(cuda_products, "_launch_normed", stand_in_normed)
    mx.random.seed(6)
    o_proj, down = mnn.Linear(32, 64, bias=False), mnn.Linear(48, 64, bias=False)
    norm = mnn.RMSNorm(64, 1e-5, offset=1.0)
    norm.weight = 0.1 * mx.random.normal((64,))
    x, r, z = mx.random.normal((1, 1, 32)), mx.random.normal((1, 1, 64)), \
        mx.random.normal((1, 1, 48))
    want_h = r + x @ o_proj.weight.T

    def close(a: mx.array, b: mx.array) -> None:
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4)

    h = o_proj(x, r)  # h = r + o_proj(x): a residual product
    assert launches == ["res"]
    taps = mnn.Taps([0], 1)
    taps.after(0, h)
    normed = norm(h)
    assert launches == ["res", "then"] and cases[-1][-1] == "then"
    close(normed, mx.fast.rms_norm(want_h, 1 + norm.weight, 1e-5))
    close(cuda_products.current(h), want_h + 1000)
    close(down(z, h), want_h + 1000 + z @ down.weight.T)  # the next residual add: renamed
    close(taps.result(normed)[1], want_h + 1000)
    # a post norm's add, then a norm of it: the add-norm product launched again with both
    post = mnn.RMSNorm(64, 1e-6)
    h2 = post.add_normed(want_h, o_proj(x), mx.array([0.5]))
    assert launches[-1] == "post"
    want_h2 = (want_h + mx.fast.rms_norm(x @ o_proj.weight.T, post.weight, 1e-6)) * 0.5
    close(norm(h2), mx.fast.rms_norm(want_h2, 1 + norm.weight, 1e-5))
    assert launches[-1] == "then" and cases[-1][-3:] == ("post", 2, "then")
    y = o_proj(x)
    close(post.add_normed(h2, y), want_h2 + 1000 + mx.fast.rms_norm(y, post.weight, 1e-6))
    count = len(launches)
    close(norm(want_h), mx.fast.rms_norm(want_h, 1 + norm.weight, 1e-5))
    assert len(launches) == count  # no product made its input: MLX's norm


def _chain_links(kind: str, rows: int, dtype=mx.float32) -> list:
    """Links as a decode step chains them: ``gemma``, a Gemma 4 layer's end (o with its post
    norm's add and the next norm, gate/up, down with its post norm's add of o's stream, the
    per-layer gate times its input, the projection with a scaled post norm's add of down's
    stream and the next norm); ``qwen``, a pre-norm layer's end and the next layer's input
    product (o plus the stream with the norm after it, gate/up, down plus o's stream with the
    norm after it, the next product); ``pair``, a gated product and the product reading it.
    Sizes not whole numbers of a block's 8 outputs."""
    Link, Ref = cuda_products.Link, cuda_products.Ref
    keys = iter(mx.random.split(mx.random.key(rows + len(kind)), 32))

    def normal(*shape, scale=1.0, shift=0.0):
        return (shift + scale * mx.random.normal(shape, key=next(keys))).astype(dtype)

    def weight(n, k):
        return normal(n, k, scale=k ** -0.5)

    def norm(n):
        return normal(n, scale=0.1, shift=1.0), 1e-6

    H, F, P, M = 68, 100, 20, rows
    x = normal(M, 52)
    if kind == "pair":
        return [Link(x, weight(2 * F, 52), 2), Link(normal(M, F), weight(H, F))]
    if kind == "qwen":
        return [Link(x, weight(H, 52), residual=normal(M, H), then=norm(H)),
                Link(normal(M, H), weight(2 * F, H), 1),
                Link(normal(M, F), weight(H, F), residual=Ref(0, "y"), then=norm(H)),
                Link(normal(M, H), weight(44, H))]
    return [Link(x, weight(H, 52), post=(normal(M, H), *norm(H), None), then=norm(H)),
            Link(normal(M, H), weight(2 * F, H), 2),
            Link(normal(M, F), weight(H, F), post=(Ref(0, "h"), *norm(H), None)),
            Link(normal(M, H), weight(P, H), 2, up=normal(M, P, scale=2.0)),
            Link(normal(M, P), weight(H, P), post=(Ref(2, "h"), *norm(H), normal(1, shift=0.6)),
                 then=norm(H))]


@emulated
@pytest.mark.parametrize("kind,rows", [("pair", 1), ("qwen", 3), ("gemma", 1), ("gemma", 4)])
def test_a_chain_runs_its_links_one_after_another_in_emulation(kind, rows):
    """One launch: blocks draw tickets, the first links' blocks run first, each later link's
    wait for the link before it, then run its product (and tail) on the rows it wrote; every
    link's rows as MLX's operations give them, the counters back at 0 for the next launch."""
    from mlxrunner.testing.cuda_emulation import emulate_kernel

    mx.set_default_device(mx.cpu)
    links = _chain_links(kind, rows)
    kernel, inputs, template, layout, blocks = cuda_products.chain_arguments(links)
    arrays = {name: np.array(value) for name, value in inputs.items()}
    want = cuda_products._reference_links(links)
    size = cuda_products.chain_size(layout)
    for _ in range(2):  # the counters are reset for the next launch
        flat = emulate_kernel(kernel.source, arrays, {"rows": ((size,), np.float32)},
                              template, blocks=blocks, threads=cuda_products.THREADS)["rows"]
        for name, (at, shape) in layout.items():
            role, i = name.rsplit("_", 1)
            got = flat[at:at + int(np.prod(shape))].reshape(shape)
            np.testing.assert_allclose(got, np.array(want[int(i)][role]), rtol=1e-4,
                                       atol=1e-4, err_msg=name)
        counters = [value for name, value in arrays.items()
                    if name == "chain" or name.startswith("cnt_")]
        assert all(not c.any() for c in counters), counters
    assert set(layout) == {f"{role}_{i}" for i, r in enumerate(want) for role in r}
    # one output, its row sets apart and each starting on a 16-entry boundary
    spans = sorted((at, at + int(np.prod(shape))) for at, shape in layout.values())
    assert all(end <= after for (_, end), (after, _) in zip(spans, spans[1:])), spans
    assert all(at % cuda_products.ROW_ALIGN == 0 for at, _ in spans), spans


@emulated
@pytest.mark.parametrize("glu", [1, 2])
def test_a_gate_product_times_a_given_up_computes_its_math_in_emulation(glu):
    """``act(x @ Wg.T) * up`` with ``up`` an input (a per-layer input, not the
    weight's up rows): the weight has N rows."""
    from mlxrunner.testing.cuda_emulation import emulate_kernel

    rng = np.random.default_rng(glu)
    rows, K, N, threads = 2, 64, 24, 256
    x = rng.normal(size=(rows, K)).astype(np.float32)
    w = (rng.normal(size=(N, K)) * K ** -0.5).astype(np.float32)
    up = rng.normal(size=(rows, N)).astype(np.float32)
    got = emulate_kernel(
        cuda_products.PRODUCT_SOURCE,
        {"x": x, "w": w, "res": None, "up_x": up},
        {"y": ((rows, N), np.float32)},
        [("T", mx.float32), ("K", K), ("N", N), ("M", rows), ("NT", threads),
         ("RES", False), ("GLU", glu), ("UPX", True), ("ADDN", False)],
        blocks=-(-N // (threads // 32)), threads=threads)["y"]
    gate = _reference_np(x, w, None, 0)
    act = gate / (1 + np.exp(-gate)) if glu == 1 else 0.5 * gate * (
        1 + np.tanh(0.7978845608028654 * (gate + 0.044715 * gate ** 3)))
    np.testing.assert_allclose(got, act * up, rtol=1e-5, atol=1e-5)


@on_cuda
def test_packed_and_plain_images_launch_the_same_product():
    """On a GPU with nvFatbin installed (requirements-test.txt; the cuda13 extra) the
    product launches as a packed image the driver loaded, and gives what its cubin gives."""
    from mlxrunner.nn import cuda_build

    mx.set_default_device(mx.gpu)
    build = cuda_build.builder()
    if build is None or cuda_build.find_nvfatbin() is None:
        pytest.skip("no NVRTC or no nvFatbin on this GPU machine")
    mx.random.seed(3)
    x = mx.random.normal((1, 1, 1024)).astype(mx.bfloat16)
    w = (mx.random.normal((3584, 1024)) * 0.03).astype(mx.bfloat16)
    got = {}
    for packed in (False, True):
        with settings.overridden(packed_kernels=packed):
            y = cuda_products.fused_product(x, w)
            assert y is not None
            got[packed] = np.array(y.astype(mx.float32))
    assert build.packer is not None and build.packed, "the driver loaded no packed image"
    assert all(image[:4] == bytes.fromhex("50ed55ba") for image in build.packed.values())
    np.testing.assert_array_equal(got[True], got[False])


def test_a_block_counter_is_a_constant_of_the_cores_compiled_functions(monkeypatch):
    """A launch's block counters (the add-norm product's, split attention's): at least 16
    bytes of zeros (past MLX's pool of managed scalars, whose pages the host touches every
    step), evaluated while the core traces a
    function for ``mx.compile`` (a constant every call reuses, one per launch: lazy ones
    MLX's compile would merge), left to the graph elsewhere (a fill before the launch); the
    core's compiled decode step traces inside ``compiling``."""
    from mlxrunner.constants import compiling, in_compiled
    from mlxrunner.decode import forward
    from plain_mlx_model import PlainModel

    evaluated = []
    real_eval = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *arrays: evaluated.extend(arrays) or
                        real_eval(*arrays))
    lazy = cuda_build.block_counters(1)
    assert evaluated == []
    made = []

    def two_launches(x: mx.array) -> mx.array:
        made.extend([cuda_build.block_counters(1), cuda_build.block_counters(1)])
        return x + made[-1].sum() + made[-2].sum()

    with compiling():
        mx.compile(two_launches)(mx.array(1))
    assert [id(a) for a in evaluated] == [id(a) for a in made] and len(made) == 2
    for counter in (lazy, *made):
        assert counter.dtype == mx.int32 and counter.nbytes > 8 and counter.tolist() == [0] * 4
    assert cuda_build.block_counters(9).tolist() == [0] * 9  # one a query row, say
    monkeypatch.undo()

    seen = []

    class Recording(PlainModel):
        def __call__(self, *args, **kwargs):
            seen.append(in_compiled())
            return super().__call__(*args, **kwargs)

    mx.random.seed(0)
    model = Recording(None)
    cache = model.make_cache()
    mx.eval(model(mx.array([[3, 4, 5]]), cache))
    seen.clear()
    with settings.overridden(compile=True):
        forward(model, mx.array([[6]]), cache)
    assert seen[0] is True and False in seen, seen  # traced, then checked eagerly
