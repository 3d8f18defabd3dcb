"""The core's layers on the host (mlxrunner.nn.host_ops) and quantized products read from
MLX's quantized words (mlxrunner.nn.host_quantized), on MLX's CPU device off macOS.

Each is checked against MLX's own function on the same inputs in float32: quantized products
against ``x @ mx.dequantize(...).T`` (tolerance 1e-5 of the largest output: float32 sums in
another order), attention against ``mx.fast.scaled_dot_product_attention`` with every mask
form, norms and RoPE against ``mx.fast`` (large offsets included). A product's rows do not
depend on how many rows it was called with (a verify block's rows equal one-row steps bit for
bit). Outside ``hosting()`` nothing runs on the host, so gradients flow as MLX's; a model
decodes to the same greedy tokens with the host layers on and off."""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mlxrunner
import mlxrunner.nn as mnn
from mlxrunner import settings
from mlxrunner.nn import host_build, host_ops
from mlxrunner_test_support import EXAMPLE_CONFIG, write_model_folder

mx.set_default_device(mx.cpu)

pytestmark = pytest.mark.skipif(sys.platform == "darwin",
                                reason="the host layers serve MLX's CPU device off macOS")

TOLERANCE = 1e-5  # of the largest output


def close(got: mx.array, want: mx.array, tolerance: float = TOLERANCE) -> bool:
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype
    return float(mx.abs(got - want).max()) <= tolerance * (1.0 + float(mx.abs(want).max()))


@pytest.fixture
def kernels():
    built = host_build.host_kernels()
    if built is None:
        pytest.skip("no C compiler here: quantized layers keep float32 copies")
    return built


@pytest.fixture
def product_calls(kernels, monkeypatch):
    """The rows' shapes of every quantized product the C loops run from here on."""
    calls = []
    real = kernels.product

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "product", counted)
    return calls


def quantized(out_dims: int, in_dims: int, group: int, bits: int, seed: int = 0):
    w = mx.random.normal((out_dims, in_dims), key=mx.random.key(seed))
    q, s, b = mx.quantize(w, group_size=group, bits=bits)
    mx.eval(q, s, b)
    return q, s, b


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_quantized_products_agree_with_mlx(kernels, bits, group):
    q, s, b = quantized(200, 384, group, bits)
    want_w = mx.dequantize(q, s, b, group_size=group, bits=bits)
    arrays = (np.asarray(q), np.asarray(s), np.asarray(b))
    for rows in (1, 3, 4, 5, host_build.KERNEL_MAX_ROWS, host_build.KERNEL_MAX_ROWS + 1,
                 70):
        x = mx.random.normal((rows, 384), key=mx.random.key(rows))
        got = mx.array(kernels.product(np.asarray(x), *arrays, group_size=group, bits=bits))
        assert close(got, x @ want_w.T), rows


def test_a_products_rows_do_not_depend_on_the_row_count(kernels):
    q, s, b = quantized(512, 576, 32, 4)
    arrays = (np.asarray(q), np.asarray(s), np.asarray(b))
    x = np.asarray(mx.random.normal((host_build.KERNEL_MAX_ROWS, 576)))
    block = kernels.product(x, *arrays, group_size=32, bits=4)
    for r in range(x.shape[0]):
        alone = kernels.product(np.ascontiguousarray(x[r:r + 1]), *arrays, group_size=32, bits=4)
        assert np.array_equal(alone[0], block[r]), r


def test_split_and_whole_products_are_the_same(kernels, monkeypatch):
    q, s, b = quantized(1024, 1024, 64, 4)
    arrays = (np.asarray(q), np.asarray(s), np.asarray(b))
    x = np.asarray(mx.random.normal((2, 1024)))
    monkeypatch.setattr(host_build, "SPLIT_MIN_WEIGHTS", 1)
    split = kernels.product(x, *arrays, group_size=64, bits=4)
    monkeypatch.setattr(host_build, "SPLIT_MIN_WEIGHTS", 1 << 40)
    whole = kernels.product(x, *arrays, group_size=64, bits=4)
    assert np.array_equal(split, whole)


def _product_in_child(kernels, x, arrays, want, done) -> None:
    done.put(bool(np.array_equal(kernels.product(x, *arrays, group_size=32, bits=4), want)))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_split_products_from_two_threads_and_a_forked_child(kernels, monkeypatch):
    monkeypatch.setattr(host_build, "SPLIT_MIN_WEIGHTS", 1)
    q, s, b = quantized(512, 512, 32, 4)
    arrays = (np.asarray(q), np.asarray(s), np.asarray(b))
    x = np.asarray(mx.random.normal((1, 512)))
    want = kernels.product(x, *arrays, group_size=32, bits=4)
    same: list[bool] = []

    def work() -> None:
        for _ in range(200):
            same.append(bool(np.array_equal(kernels.product(x, *arrays, group_size=32, bits=4),
                                            want)))

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(same) == 400 and all(same)
    # a child forked after the helper started has none: it must not wait for one
    context = multiprocessing.get_context("fork")
    done = context.Queue()
    child = context.Process(target=_product_in_child, args=(kernels, x, arrays, want, done))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0 and done.get(timeout=1) is True


def test_quantized_layers_run_on_the_host_only_while_hosting(product_calls):
    layer = nn.QuantizedLinear(512, 256, bias=True, group_size=64, bits=4)
    layer.bias = mx.random.normal((256,))
    x = mx.random.normal((1, 2, 512))
    calls = product_calls
    want = layer(x)
    with host_ops.hosting():
        got = mnn.apply_linear(layer, x)
    assert calls and calls[-1] == (2, 512)
    assert close(got, want)
    calls.clear()
    mnn.apply_linear(layer, x)
    assert not calls


@pytest.mark.parametrize("mask", [None, "causal", "bool", "additive"])
@pytest.mark.parametrize("shape", [(1, 9, 3, 1, 40), (2, 8, 2, 5, 12), (1, 4, 4, 6, 6)])
def test_attention_agrees_with_mlx(mask, shape):
    B, Hq, Hk, L, S = shape
    keys = mx.random.normal((3, B, Hk, S, 32), key=mx.random.key(L * S))
    q = mx.random.normal((B, Hq, L, 32), key=mx.random.key(7))
    if mask == "bool":
        m = mx.random.uniform(shape=(L, S)) > 0.3
        m = m | (mx.arange(S)[None] == 0)  # every row keeps a key
    elif mask == "additive":
        m = mx.random.normal((B, 1, L, S))
    else:
        m = mask
    want = mx.fast.scaled_dot_product_attention(q, keys[0], keys[1], scale=0.2, mask=m)
    with host_ops.hosting():
        got = host_ops.host_attention(q, keys[0], keys[1], m, 0.2)
    assert got is not None
    assert close(got, want)


def test_long_query_blocks_attend_in_slices(monkeypatch):
    q = mx.random.normal((1, 4, 64, 16))
    k, v = mx.random.normal((1, 2, 64, 16)), mx.random.normal((1, 2, 64, 16))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    monkeypatch.setattr(host_ops, "SCORES_MAX_ELEMENTS", 4 * 64 * 5)  # 5 queries a slice
    with host_ops.hosting():
        got = host_ops.host_attention(q, k, v, "causal", 0.25)
    assert got is not None and close(got, want)


@pytest.fixture(params=["C loops", "numpy"])
def loops(request, monkeypatch):
    """The host layers through the core's C loops (where built) and through numpy."""
    if request.param == "numpy":
        monkeypatch.setattr(host_ops, "host_kernels", lambda: None)
    elif host_build.host_kernels() is None:
        pytest.skip("no C compiler here")
    return request.param


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("offset", [0, 7, 30000, "per row"])
def test_rope_agrees_with_mlx(traditional, offset, loops):
    x = mx.random.normal((2, 3, 5, 64))
    offset = mx.array([3, 900]) if offset == "per row" else mx.array(offset)
    freqs = mx.exp(mx.linspace(0, 6, 16))
    cases = [dict(dims=64, base=10000.0, scale=1.0, freqs=None),
             dict(dims=32, base=500000.0, scale=0.5, freqs=None),
             dict(dims=32, base=None, scale=1.0, freqs=freqs)]
    for case in cases:
        want = mx.fast.rope(x, case["dims"], traditional=traditional, base=case["base"],
                            scale=case["scale"], offset=offset, freqs=case["freqs"])
        with host_ops.hosting():
            got = host_ops.host_rope(x, case["dims"], traditional=traditional,
                                     base=case["base"], scale=case["scale"],
                                     offset=offset, freqs=case["freqs"])
        assert got is not None
        assert close(got, want), case


def test_norm_activation_add_and_split_agree_with_mlx(loops):
    x = mx.random.normal((2, 3, 96))
    w = mx.random.normal((96,))
    with host_ops.hosting():
        norm = host_ops.host_rms_norm(x, w, 1e-5)
        bare = host_ops.host_rms_norm(x, None, 1e-5)
        act = host_ops.host_silu_mul(x, x * 2)
        added = host_ops.host_add(x, w)
        parts = host_ops.host_split(x, [10, 50])
    assert norm is not None and close(norm, mx.fast.rms_norm(x, w, 1e-5))
    assert bare is not None and close(bare, mx.fast.rms_norm(x, None, 1e-5))
    assert act is not None and close(act, nn.silu(x) * (x * 2))
    assert added is not None and close(added, x + w)
    assert parts is not None
    for got, want in zip(parts, mx.split(x, [10, 50], axis=-1)):
        assert close(got, want)


def test_nothing_runs_on_the_host_outside_hosting_or_in_other_dtypes():
    x = mx.random.normal((1, 4, 64))
    assert host_ops.host_rms_norm(x, None, 1e-5) is None
    with host_ops.hosting():
        assert host_ops.host_rms_norm(x.astype(mx.bfloat16), None, 1e-5) is None
    # (whether products run on the host is asked as a hosting block starts)
    with settings.overridden(host_products=False), host_ops.hosting():
        assert host_ops.host_rms_norm(x, None, 1e-5) is None


def test_gradients_through_the_layers_are_mlxs():
    norm = mnn.RMSNorm(32)
    norm.weight = mx.random.normal((32,))
    rope = mnn.RoPE(32)
    x = mx.random.normal((1, 2, 3, 32))

    def loss(x):
        return (rope(norm(x), 5) ** 2).sum()

    grad = mx.grad(loss)(x)
    assert float(mx.abs(grad).max()) > 0


def test_a_quantized_model_decodes_the_same_with_host_layers_on_and_off(tmp_path,
                                                                      product_calls):
    # products of at least HOST_PRODUCT_MIN_SIZE weights: hidden 256, MLP 512
    config = dict(EXAMPLE_CONFIG, hidden_size=256, intermediate_size=512, head_dim=64)
    folder = write_model_folder(tmp_path / "m", config, seed=3)
    bundle = mlxrunner.load(str(folder))
    nn.quantize(bundle.model, group_size=32, bits=4)
    calls = product_calls
    prompt = list(range(3, 40))
    greedy = mlxrunner.SamplerOptions(temperature=0)
    on = mlxrunner.generate(bundle.model, prompt, options=greedy, max_tokens=24)
    with settings.overridden(host_products=False):
        off = mlxrunner.generate(bundle.model, prompt, options=greedy, max_tokens=24)
    assert on.tokens == off.tokens
    assert (1, 256) in calls  # the decode steps' products ran on the host


def test_a_model_whose_products_run_on_the_host_is_never_traced(tmp_path, kernels):
    """Its prefill ran 4M+ weights' products on the host (as a decode step would), so its
    decode steps run eagerly from the first: no trace is made (tracing the default model's
    first step cost 0.3 s) and no float32 copy of its quantized weights either."""
    from mlxrunner.decode import compiled_steps

    config = dict(EXAMPLE_CONFIG, hidden_size=512, intermediate_size=2048, head_dim=128)
    folder = write_model_folder(tmp_path / "m", config, seed=4)
    bundle = mlxrunner.load(str(folder))
    nn.quantize(bundle.model, group_size=64, bits=4)
    greedy = mlxrunner.SamplerOptions(temperature=0)
    mx.eval(bundle.model.parameters())
    before = mx.get_active_memory()
    got = mlxrunner.generate(bundle.model, list(range(3, 20)), options=greedy, max_tokens=6)
    assert compiled_steps(bundle.model).traces_made == 0
    # no float32 copies: 8M weights would hold 32 MB more
    assert mx.get_active_memory() - before < 8 * 2**20
    with settings.overridden(host_products=False):
        traced = mlxrunner.generate(bundle.model, list(range(3, 20)), options=greedy,
                                    max_tokens=6)
    assert compiled_steps(bundle.model).traces_made > 0
    assert got.tokens == traced.tokens
