"""The fused sandwich-norm kernel: where it applies, its fallback, and (on CUDA) that it
computes what MLX's operations compute."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlxrunner_gemma4 import cuda_kernels as ck

from mlxrunner.testing.cuda_emulation import emulate_kernel, emulation_available


@pytest.fixture
def on_gpu():
    """The GPU as the default device for one test (other test modules here set the CPU)."""
    previous = mx.default_device()
    mx.set_default_device(mx.gpu)
    yield
    mx.set_default_device(previous)

CUDA = hasattr(mx, "cuda") and mx.cuda.is_available()


def _arrays(rows: int = 3, width: int = 64, dtype: mx.Dtype = mx.float32):
    keys = mx.random.split(mx.random.key(0), 4)
    x = (3 * mx.random.normal((rows, width), key=keys[0])).astype(dtype)
    residual = mx.random.normal((rows, width), key=keys[1]).astype(dtype)
    w = (1 + 0.1 * mx.random.normal((width,), key=keys[2])).astype(dtype)
    w2 = (1 + 0.1 * mx.random.normal((width,), key=keys[3])).astype(dtype)
    return x, residual, w, w2


def test_reference_is_the_sandwich_composition():
    x, residual, w, w2 = _arrays()
    scalar = mx.array([0.5])
    h, normed = ck.reference(x, residual, w, 1e-6, scalar, w2)
    xn, rn = np.array(x, np.float64), np.array(residual, np.float64)
    y = xn / np.sqrt((xn ** 2).mean(-1, keepdims=True) + 1e-6) * np.array(w)
    want_h = (rn + y) * 0.5
    want_n = want_h / np.sqrt((want_h ** 2).mean(-1, keepdims=True) + 1e-6) * np.array(w2)
    np.testing.assert_allclose(np.array(h), want_h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(normed), want_n, rtol=1e-5, atol=1e-5)
    h2, none = ck.reference(x, residual, w, 1e-6)
    assert none is None
    np.testing.assert_allclose(np.array(h2), rn + y, rtol=1e-5, atol=1e-5)


def test_off_the_gpu_norm_add_is_the_reference():
    if CUDA:
        pytest.skip("on CUDA the kernel may run")
    x, residual, w, w2 = _arrays()
    got = ck.norm_add(x, residual, w, 1e-6, second=w2)
    want = ck.reference(x, residual, w, 1e-6, second=w2)
    assert mx.array_equal(got[0], want[0]) and mx.array_equal(got[1], want[1])


def test_where_the_kernel_applies(monkeypatch):
    monkeypatch.setattr(ck, "cuda_backend", lambda: True)
    x, residual, w, w2 = _arrays(4, 32, mx.bfloat16)
    assert ck._key(x, residual, w, None, w2, 1e-6, None) is not None
    assert ck._key(x, residual, w, mx.array([1.0], mx.bfloat16), None, 1e-6, 1e-6) is not None
    # what it does not serve: prompts, mixed dtypes, a float32 scalar on bf16 rows,
    # another epsilon for the second norm, a weight of another width
    big = mx.zeros((ck.MAX_ROWS + 1, 32), mx.bfloat16)
    assert ck._key(big, big, w, None, None, 1e-6, None) is None
    assert ck._key(x, residual.astype(mx.float32), w, None, None, 1e-6, None) is None
    assert ck._key(x, residual, w, mx.array([1.0]), None, 1e-6, None) is None
    assert ck._key(x, residual, w, None, w2, 1e-6, 1e-5) is None
    assert ck._key(x, residual, w[:16], None, None, 1e-6, None) is None
    monkeypatch.setenv(ck.ENV_SWITCH, "0")
    assert ck._key(x, residual, w, None, None, 1e-6, None) is None


def test_a_failing_kernel_falls_back_once(monkeypatch, capsys):
    monkeypatch.setattr(ck, "cuda_backend", lambda: True)
    monkeypatch.setattr(ck, "_verdicts", {})
    calls = []

    def broken(*args):
        calls.append(1)
        raise ValueError("[custom_kernel] refused")

    monkeypatch.setattr(ck, "_launch", broken)
    x, residual, w, w2 = _arrays()
    for _ in range(2):
        got = ck.norm_add(x, residual, w, 1e-6, second=w2)
        want = ck.reference(x, residual, w, 1e-6, second=w2)
        assert mx.array_equal(got[0], want[0]) and mx.array_equal(got[1], want[1])
    assert len(calls) == 1  # the self-check, once
    assert capsys.readouterr().err.count("fused norm kernel unavailable") == 1


@pytest.mark.skipif(not CUDA, reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("rows,width", [(1, 1536), (8, 1536), (3, 200)])
def test_kernel_matches_mlx_operations(on_gpu, dtype, rows, width):
    x, residual, w, w2 = _arrays(rows, width, dtype)
    scalar = mx.array([0.7], dtype)
    tolerance = 1e-5 if dtype == mx.float32 else 2e-2
    for s, second in ((None, None), (scalar, None), (None, w2), (scalar, w2)):
        got = ck._launch(x, residual, w, 1e-6, s, second)
        want = ck.reference(x, residual, w, 1e-6, s, second)
        for a, b in zip(got, want):
            assert (a is None) == (b is None)
            if a is not None:
                np.testing.assert_allclose(np.array(a.astype(mx.float32)),
                                           np.array(b.astype(mx.float32)),
                                           rtol=tolerance, atol=tolerance)


@pytest.mark.skipif(not emulation_available(), reason="needs a host C++ compiler (g++)")
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("second", [False, True])
def test_kernel_source_computes_the_reference_on_the_cpu(scaled, second):
    """The kernel body run by the host emulation of CUDA's threads (float32), against
    MLX's operations: 3 rows of 200 values (not a multiple of the 64 threads)."""
    rows, width, threads = 3, 200, 64
    x, residual, w, w2 = _arrays(rows, width)
    scalar = mx.array([0.7])
    got = emulate_kernel(
        ck.NORM_ADD_SOURCE,
        {"x": np.array(x), "residual": np.array(residual), "w": np.array(w),
         "scalar": np.array(scalar if scaled else w[:1]), "w2": np.array(w2 if second else w)},
        {"h_out": ((rows, width), np.float32),
         "normed_out": ((rows, width) if second else (1,), np.float32)},
        [("T", mx.float32), ("H", width), ("NT", threads), ("SCALED", scaled),
         ("SECOND", second), ("EPS_E9", 1000)], blocks=rows, threads=threads)
    h, normed = ck.reference(x, residual, w, 1e-6, scalar if scaled else None,
                             w2 if second else None)
    np.testing.assert_allclose(got["h_out"], np.array(h), rtol=2e-6, atol=2e-6)
    if second:
        np.testing.assert_allclose(got["normed_out"], np.array(normed), rtol=2e-6, atol=2e-6)


@pytest.mark.skipif(not emulation_available(), reason="needs a host C++ compiler (g++)")
@pytest.mark.parametrize("fixture", ["dense", "e2b"])
def test_head_kernel_source_computes_norms_and_rope_on_the_cpu(fixture):
    """Every attention layer of the tiny fixtures (sliding and full layers, plain and
    proportional RoPE, K=V, KV sharing): the head kernel's body under the host emulation
    (float32) gives MLX's q, k and v, for 2 sequences of 3 tokens at position 37."""
    from pathlib import Path

    import mlxrunner

    folder = Path(__file__).parent / "fixtures" / fixture
    model = mlxrunner.load_model(str(folder))
    model._fuse()
    B, L = 2, 3
    position = mx.array([37], dtype=mx.int32)
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        x = mx.random.normal((B * L, attn.hidden_size), key=mx.random.key(i))
        rows = attn.fused.proj(x) if attn.fused is not None else attn.q_proj(x)
        want = attn._project_rows(rows, L, position)
        hq, hk, hv, kv_from_k = attn._heads_layout()
        D = attn.head_dim
        values = hk if kv_from_k else hv
        outputs = {"q_out": ((B, hq, L, D), np.float32),
                   "k_out": ((B, hk, L, D) if hk else (1,), np.float32),
                   "v_out": ((B, values, L, D) if values else (1,), np.float32)}
        threads = 32 * -(-D // 32)
        got = emulate_kernel(
            ck.HEADS_SOURCE,
            {"rows": np.array(rows), "q_weight": np.array(attn.q_norm.weight),
             "k_weight": np.array(attn.k_norm.weight if attn.has_kv else attn.q_norm.weight),
             "inv_freq": np.array(attn.inv_freq()), "position": np.array(position),
             "seq": np.array([L], np.int32)},
            outputs,
            [("T", mx.float32), ("HQ", hq), ("HK", hk), ("HV", hv), ("KV_FROM_K", kv_from_k),
             ("D", D), ("P", rows.shape[-1]), ("NT", threads), ("EPS_E9", 1000)],
            blocks=B * L * (hq + hk + hv), threads=threads)
        for name, w in zip(("q_out", "k_out", "v_out"), want):
            if w is None:
                continue
            np.testing.assert_allclose(got[name], np.array(w), rtol=1e-4, atol=1e-4,
                                       err_msg=f"layer {i} {name}")


def test_head_kernel_is_gated_and_falls_back(monkeypatch, capsys):
    """On CUDA a head kernel that fails its self-check stays off (one warning per layer
    layout) and the projections are MLX's, unchanged."""
    from pathlib import Path

    import mlxrunner

    model = mlxrunner.load_model(str(Path(__file__).parent / "fixtures" / "dense"))
    model._fuse()
    attn = model.model.layers[0].self_attn
    x = mx.random.normal((1, attn.hidden_size), key=mx.random.key(0))
    monkeypatch.setattr(ck, "cuda_backend", lambda: False)  # MLX's operations
    want = attn.project(x, 1, 5)
    monkeypatch.setattr(ck, "cuda_backend", lambda: True)
    monkeypatch.setattr(ck, "_heads_verdicts", {})

    def broken(*args, **kwargs):
        raise ValueError("[custom_kernel] refused")

    monkeypatch.setattr(ck, "_heads_launch", broken)
    for _ in range(2):
        got = attn.project(x, 1, 5)
        for a, b in zip(got, want):
            assert (a is None and b is None) or mx.array_equal(a, b)
    assert capsys.readouterr().err.count("fused attention-head kernel unavailable") == 1


@pytest.mark.skipif(not CUDA, reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("fixture", ["dense", "e2b"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_head_kernel_matches_mlx_operations(on_gpu, fixture, dtype):
    from pathlib import Path

    import mlxrunner

    model = mlxrunner.load_model(str(Path(__file__).parent / "fixtures" / fixture))
    model.set_dtype(dtype)
    model._fuse()
    position = mx.array(37, dtype=mx.int32)  # 0-d for MLX's rope (see heads_usable)
    tolerance = 1e-4 if dtype == mx.float32 else 3e-2
    for B, L in ((1, 8), (3, 1)):
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            x = mx.random.normal((B * L, attn.hidden_size), key=mx.random.key(i)).astype(dtype)
            rows = attn.fused.proj(x) if attn.fused is not None else attn.q_proj(x)
            weights = (attn.q_norm.weight, attn.k_norm.weight if attn.has_kv else None)
            got = ck._heads_launch(rows, *weights, attn.inv_freq(), position.reshape(1),
                                   attn._heads_layout(), attn.head_dim, attn.eps, B, L)
            for a, b in zip(got, attn._project_rows(rows, L, position)):
                assert (a is None) == (b is None)
                if a is not None:
                    np.testing.assert_allclose(np.array(a.astype(mx.float32)),
                                               np.array(b.astype(mx.float32)),
                                               rtol=tolerance, atol=tolerance)


def test_kernel_switch(monkeypatch):
    """The plugin's kernels answer to its switch, and only on CUDA."""
    monkeypatch.setattr(ck, "cuda_backend", lambda: True)
    monkeypatch.setenv(ck.ENV_SWITCH, "norm_add")
    assert ck.kernel_on("norm_add") and not ck.kernel_on("heads")
    monkeypatch.delenv(ck.ENV_SWITCH)
    assert ck.kernel_on("norm_add") and ck.kernel_on("heads")
    monkeypatch.setattr(ck, "cuda_backend", lambda: False)
    assert not ck.kernel_on("norm_add")
