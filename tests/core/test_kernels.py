"""mlxrunner.nn.kernels.check_kernel / outputs_agree: the first-use check of a fused kernel."""

from __future__ import annotations

import mlx.core as mx
import pytest

import mlxrunner
from mlxrunner import nn as mnn
from mlxrunner import settings
from mlxrunner.nn import arange_constant, constant, kernels
from mlxrunner_test_support import graph_labels, logged


def test_outputs_agree_within_the_tolerance():
    want = (mx.array([1.0, -2.0, 3.0]), None)
    assert kernels.outputs_agree((want[0] + 1e-4, None), want, 1e-4)
    assert not kernels.outputs_agree((want[0] + 1e-2, None), want, 1e-4)
    assert not kernels.outputs_agree((want[0], want[0]), want, 1e-4)  # None expected
    assert not kernels.outputs_agree(want[0].astype(mx.float16), want[0], 1.0)  # dtype
    assert not kernels.outputs_agree(want[0][:2], want[0], 1.0)  # shape
    assert not kernels.outputs_agree([want[0]], [want[0], want[0]], 1.0)  # count


def test_check_kernel_says_why_it_refuses(caplog):
    x = mx.arange(4, dtype=mx.float32)
    assert kernels.check_kernel("k", lambda: x * 2, lambda: x + x, 1e-6)
    assert logged(caplog) == ""
    assert not kernels.check_kernel("my kernel", lambda: x * 3, lambda: x + x, 1e-3)
    assert logged(caplog).strip() == (
        "my kernel disagrees with MLX's operations; using MLX's operations")

    def refused():
        raise ValueError("[custom_kernel] refused\nsecond line")

    assert not kernels.check_kernel("my kernel", refused, lambda: x, 1e-3,
                                    against="the plain step")
    assert logged(caplog).strip() == (
        "my kernel unavailable (ValueError: [custom_kernel] refused); using the plain step")


def test_switch_allows(monkeypatch):
    variable, known = "MLXRUNNER_TEST_KERNELS", ("a", "b")
    monkeypatch.delenv(variable, raising=False)
    assert kernels.switch_allows(variable, "a", known)
    for value, allowed in (("1", {"a", "b"}), ("0", set()), ("a", {"a"}), (" a,b ", {"a", "b"})):
        monkeypatch.setenv(variable, value)
        assert {n for n in known if kernels.switch_allows(variable, n, known)} == allowed
    monkeypatch.setenv(variable, "a,c")  # a typo must not turn kernels off unnoticed
    with pytest.raises(mlxrunner.MLXRunnerError, match="unknown kernel 'c'"):
        kernels.switch_allows(variable, "a", known)


def test_constants_are_made_once_and_are_no_operation_in_a_trace():
    a = constant((3, 1, 2), mx.int32)
    assert a is constant((3, 1, 2), mx.int32)  # made once
    assert a.tolist() == [3, 1, 2] and a.dtype == mx.int32
    assert constant((3, 1, 2), mx.float32).dtype == mx.float32
    r = arange_constant(5)
    assert r is arange_constant(5) and r.tolist() == [0, 1, 2, 3, 4]

    def positions(offset: mx.array, made_once: bool) -> mx.array:
        steps = arange_constant(6) if made_once else mx.arange(6)
        return offset + steps

    for made_once in (True, False):
        traced = mx.compile(lambda o, m=made_once: positions(o, m))
        out = traced(mx.array(4, mx.int32))
        assert out.tolist() == [4, 5, 6, 7, 8, 9]
        assert ("Arange" in graph_labels(traced(mx.array(1, mx.int32)))) != made_once


CUDA = hasattr(mx, "cuda") and mx.cuda.is_available()


@pytest.mark.parametrize("bias", [False, True])
def test_a_prompt_chunks_rows_take_the_plain_product_on_cuda(monkeypatch, bias):
    """On CUDA a float layer's product of more rows than row products or fused products
    take (a prompt chunk's) is MLX's plain one, its bias and residual added; fewer rows
    still ask the step's paths (here the row products' GatherMM)."""
    monkeypatch.setattr(kernels, "on_cuda", lambda: True)
    layer = mnn.Linear(64, 48, bias=bias)
    for rows in (kernels.ROW_PRODUCT_MAX_ROWS, kernels.ROW_PRODUCT_MAX_ROWS + 1, 40):
        x = mx.random.normal((1, rows, 64), key=mx.random.key(rows))
        residual = mx.random.normal((1, rows, 48), key=mx.random.key(rows + 1))
        want = x @ layer.weight.T + (layer.bias if bias else 0)
        plain = rows > kernels.ROW_PRODUCT_MAX_ROWS
        assert kernels.mlx_product_rows(x) == plain
        assert mx.allclose(layer(x), want, atol=1e-5).item()
        assert mx.allclose(layer(x, residual), want + residual, atol=1e-5).item()
        traced = mx.compile(lambda a, r: layer(a, r))
        assert ("GatherMM" in graph_labels(traced(x, residual))) == (not plain and not bias)
    monkeypatch.setattr(kernels, "on_cuda", lambda: False)
    assert not kernels.mlx_product_rows(mx.zeros((1, 40, 64)))


@pytest.mark.parametrize("shape", [(2, 64), (1, 8, 96), (16, 128), (17, 64), (3, 40)])
def test_project_equals_the_product_on_every_path(monkeypatch, shape):
    """project(x, W.T) is x @ W.T: the one-row products (forced on here, on the CPU's
    GatherMM) for 2..16 rows with K a multiple of 32, the plain product otherwise."""
    monkeypatch.setattr(kernels, "on_cuda", lambda: True)
    x = mx.random.normal(shape, key=mx.random.key(1))
    weight = mx.random.normal((48, shape[-1]), key=mx.random.key(2))
    got = kernels.project(x, weight.T)
    assert got.shape == (*shape[:-1], 48)
    assert mx.allclose(got, x @ weight.T, atol=1e-5).item()
    residual = mx.random.normal(got.shape, key=mx.random.key(5))
    for cuda in (True, False):  # a separate add on CUDA, one AddMM elsewhere
        monkeypatch.setattr(kernels, "on_cuda", lambda c=cuda: c)
        with_residual = kernels.project(x, weight.T, residual)
        assert mx.allclose(with_residual, x @ weight.T + residual, atol=1e-5).item()
    monkeypatch.setattr(kernels, "on_cuda", lambda: True)
    rows = x.size // shape[-1]
    row_products = 1 < rows <= kernels.ROW_PRODUCT_MAX_ROWS and shape[-1] % 32 == 0
    assert kernels.row_products_serve(rows, x, weight.T) == row_products
    traced = mx.compile(lambda a: kernels.project(a, weight.T))
    assert ("GatherMM" in graph_labels(traced(x))) == row_products


def test_row_products_stop_at_their_row_and_weight_bounds():
    """Half-precision blocks of more than ROW_PRODUCT_MAX_HALF_ROWS rows and weights of
    more than ROW_PRODUCT_MAX_BYTES (a vocabulary's head, whose rows would each read it
    from memory again) take the plain product; float32 blocks of up to 16 rows do not."""
    x32 = mx.zeros((16, 64))
    half = x32.astype(mx.bfloat16)
    small = mx.zeros((64, 128))
    assert kernels.row_products_serve(16, x32, small)
    assert kernels.row_products_serve(kernels.ROW_PRODUCT_MAX_HALF_ROWS, half,
                                      small.astype(mx.bfloat16))
    assert not kernels.row_products_serve(kernels.ROW_PRODUCT_MAX_HALF_ROWS + 1, half,
                                          small.astype(mx.bfloat16))
    head = mx.zeros((64, kernels.ROW_PRODUCT_MAX_BYTES // 256 + 1))  # float32: > the bound
    assert not kernels.row_products_serve(2, x32, head)
    with settings.overridden(row_products=False):
        assert not kernels.row_products_serve(2, x32, small)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype,n", [(mx.float32, 8), (mx.bfloat16, 4)])
def test_project_rows_round_as_one_row_products_on_cuda(dtype, n):
    """On CUDA each row of a short block equals, bit for bit, the same row projected
    alone (the one-token decode step's product); for float32 the plain product of 8 rows
    (cuBLAS) is the path it replaces."""
    with mx.stream(mx.gpu):
        x = mx.random.normal((n, 256), key=mx.random.key(3)).astype(dtype)
        weight = mx.random.normal((1024, 256), key=mx.random.key(4)).astype(dtype)
        block = kernels.project(x, weight.T)
        rows = mx.concatenate([kernels.project(x[i:i + 1], weight.T) for i in range(n)])
        assert mx.array_equal(block, rows).item()
        assert mx.allclose(block.astype(mx.float32), (x @ weight.T).astype(mx.float32),
                           rtol=2e-2, atol=2e-2).item()


def test_a_passed_kernel_is_remembered_on_disk_by_source_mlx_and_device(tmp_path,
                                                                         monkeypatch):
    """A later process (here: the in-memory verdicts emptied) trusts a kept pass without
    probing; another source, MLX version or device checks again; a failure is not kept."""
    monkeypatch.setattr(kernels, "verdict_store", lambda: kernels.VerdictStore(tmp_path))
    monkeypatch.setattr(kernels, "_verdicts", {})
    probes = []
    x = mx.arange(4, dtype=mx.float32)

    def ask(source, kernel=lambda p: p * 2):
        return kernels.serves("k", ("case", 1), kernel, lambda p: p + p,
                              lambda: probes.append(1) or x, 1e-6, source=source)

    assert ask("v1") and len(probes) == 1
    assert ask("v1") and len(probes) == 1  # this process: in memory
    kernels._verdicts.clear()  # a new process
    assert ask("v1") and len(probes) == 1  # from disk, no probe
    kernels._verdicts.clear()
    assert ask("v2") and len(probes) == 2  # a changed kernel is checked again
    kernels._verdicts.clear()
    assert not ask("v3", kernel=lambda p: p * 3) and len(probes) == 3
    kernels._verdicts.clear()
    assert not ask("v3", kernel=lambda p: p * 3) and len(probes) == 4  # failures: every time
    key = kernels.lasting_key("k", ("case", 1), "v1", 1e-6)
    assert key == kernels.lasting_key("k", ("case", 1), "v1", 1e-6)
    assert key != kernels.lasting_key("k", ("case", 1), "v1", 1e-6, mlx_version="0.0.1")
    assert key != kernels.lasting_key("k", ("case", 1), "v1", 1e-6, device="another GPU")
    assert key != kernels.lasting_key("k", ("case", 2), "v1", 1e-6)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [key, kernels.lasting_key("k", ("case", 1), "v2", 1e-6)])


def test_verdicts_are_kept_beside_mlx_kernel_cache_and_only_on_a_gpu(tmp_path):
    with settings.overridden(kernel_cache=str(tmp_path)):
        assert kernels.kernel_cache_folder() == tmp_path / "mlxrunner"
    assert kernels.verdict_store() is None  # these tests run on the CPU


def test_a_read_only_verdict_folder_costs_a_check_not_a_failure(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    store = kernels.VerdictStore(blocked / "verdicts")  # under a file: cannot be made
    store.record_pass("k")
    assert not store.passed("k")
