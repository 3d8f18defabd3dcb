"""Products on the host BLAS (mlxrunner.nn.kernels.host_products): on MLX's CPU device off
macOS, float32 products of large enough weights run through numpy's BLAS. They agree with
MLX's products within float32 rounding of another summation order (tolerance 1e-5 times the
largest output, measured within 2e-6), a route that fails its first-use check is not used,
the switch turns it off, gradients flow through it, and a decode step that meets it runs
eagerly with the same greedy output."""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn
import pytest

import mlxrunner
import mlxrunner.nn as mnn
from mlxrunner import settings
from mlxrunner.decode import compiled_steps, forward
from mlxrunner.nn import kernels
from mlxrunner.testing import check_compiled_step, check_speculative_greedy, random_prompt
from mlxrunner_test_support import EXAMPLE_CONFIG, logged, write_model_folder

mx.set_default_device(mx.cpu)

pytestmark = pytest.mark.skipif(sys.platform == "darwin",
                                reason="products stay MLX's on macOS (Accelerate)")

TOLERANCE = 1e-5  # of the largest output
IN, OUT = 256, 512  # a weight of 2 ** 17 elements: past HOST_PRODUCT_MIN_SIZE


@pytest.fixture
def host_calls(monkeypatch):
    """Fresh first-use checks, and the host products run: (weight shape, rows shape), the
    first-use checks' included."""
    monkeypatch.setattr(kernels, "_verdicts", {})
    calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    real = kernels.host_matmul

    def counted(x, weight_t):
        calls.append((tuple(weight_t.shape), tuple(x.shape[:-1])))
        return real(x, weight_t)

    monkeypatch.setattr(kernels, "host_matmul", counted)
    return calls


def close(got: mx.array, want: mx.array) -> bool:
    assert got.shape == want.shape and got.dtype == want.dtype
    return float(mx.abs(got - want).max()) <= TOLERANCE * float(mx.abs(want).max())


def mlx_products(fn, *args):
    with settings.overridden(host_products=False):
        return fn(*args)


def test_float_and_quantized_products_agree_with_mlx(monkeypatch, host_calls):
    dequantized: list[mx.Dtype | None] = []
    real_dequantize = mx.dequantize

    def counted(*args, **kwargs):
        dequantized.append(kwargs.get("dtype"))
        return real_dequantize(*args, **kwargs)

    monkeypatch.setattr(mx, "dequantize", counted)
    mx.random.seed(0)
    plain = mnn.Linear(IN, OUT, bias=True)
    quantized = mnn.Linear(IN, OUT, bias=False).to_quantized(group_size=32, bits=4)
    mx.eval(plain.parameters(), quantized.parameters())
    for rows in (1, 2, 8, 16):
        x = mx.random.normal((1, rows, IN))
        residual = mx.random.normal((1, rows, OUT))
        assert kernels.host_products()
        for layer in (plain, quantized):
            got = layer(x, residual)
            want = mlx_products(layer, x, residual)
            assert close(got, want), (type(layer).__name__, rows)
    assert {w for w, _ in host_calls} == {(IN, OUT)}
    assert {r for _, r in host_calls} >= {(1, 1), (1, 2), (1, 8), (1, 16)}
    assert dequantized == [mx.float32]  # one float32 copy, read by every product


def test_packed_projections_and_tied_heads_run_on_the_host(host_calls):
    mx.random.seed(1)
    q, k, v = (mnn.Linear(IN, n, bias=False) for n in (OUT, OUT // 2, OUT // 2))
    embedding = mnn.Embedding(OUT, IN)
    quantized_embedding = mnn.Embedding(OUT, IN).to_quantized(group_size=32, bits=8)
    mx.eval([m.parameters() for m in (q, k, v, embedding, quantized_embedding)])
    x = mx.random.normal((2, 3, IN))
    got = mnn.linears(x, q, k, v)
    want = mlx_products(lambda: mnn.linears(x, q, k, v))
    assert all(close(a, b) for a, b in zip(got, want))
    for head in (embedding, quantized_embedding):
        assert close(head.as_linear(x), mlx_products(head.as_linear, x))
    assert ((IN, 2 * OUT), (2, 3)) in host_calls  # q, k and v as one product
    assert host_calls.count(((IN, OUT), (2, 3))) == 2  # the heads


def test_small_weights_and_other_dtypes_keep_mlx_products(host_calls):
    small = mnn.Linear(32, 64, bias=False)
    half = mnn.Linear(IN, OUT, bias=False)
    half.update({"weight": half.weight.astype(mx.float16)})
    small(mx.ones((1, 32)))
    half(mx.ones((1, IN), dtype=mx.float16))
    assert host_calls == []


def test_a_route_failing_its_check_is_not_used(monkeypatch, caplog, host_calls):
    layer = mnn.Linear(IN, OUT, bias=False)
    x = mx.random.normal((4, IN))
    want = mlx_products(layer, x)

    def off_by_a_little(x, weight_t):
        return mx.array(1.001) * (x @ weight_t)

    monkeypatch.setattr(kernels, "host_matmul", off_by_a_little)
    assert mx.array_equal(layer(x), want)
    assert logged(caplog).strip() == (
        "mlxrunner: host BLAS product disagrees with MLX's product; using MLX's product")
    assert mx.array_equal(layer(x), want) and logged(caplog) == ""  # settled once

    def broken(x, weight_t):
        raise RuntimeError("no BLAS here")

    monkeypatch.setattr(kernels, "_verdicts", {})
    monkeypatch.setattr(kernels, "host_matmul", broken)
    assert mx.array_equal(layer(x), want)
    assert logged(caplog).strip() == ("mlxrunner: host BLAS product unavailable "
                                      "(RuntimeError: no BLAS here); using MLX's product")


def test_the_switch_turns_it_off(host_calls):
    assert settings.Settings.from_environment({}).host_products
    assert not settings.Settings.from_environment({"MLXRUNNER_HOST_PRODUCTS": "0"}).host_products
    with pytest.raises(settings.SettingsError, match="MLXRUNNER_HOST_PRODUCTS='no'"):
        settings.Settings.from_environment({"MLXRUNNER_HOST_PRODUCTS": "no"})
    layer = mnn.Linear(IN, OUT, bias=False)
    with settings.overridden(host_products=False):
        assert not kernels.host_products()
        layer(mx.ones((1, IN)))
    assert host_calls == []
    layer(mx.ones((1, IN)))
    assert ((IN, OUT), (1,)) in host_calls


def test_gradients_and_traces_see_mlx_products(host_calls):
    mx.random.seed(2)
    layer = mnn.Linear(IN, OUT, bias=False)
    x = mx.random.normal((3, IN))

    def loss(model, x):
        return (model(x) ** 2).sum()

    got = nn.value_and_grad(layer, loss)(layer, x)[1]["weight"]
    want = mlx_products(lambda: nn.value_and_grad(layer, loss)(layer, x)[1]["weight"])
    assert host_calls and close(got, want)
    declined = kernels.host_declined()
    traced = mx.compile(lambda x: layer(x))
    assert close(traced(x), layer(x))
    assert kernels.host_declined() > declined  # the trace ran MLX's product, and said so


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    pytest.importorskip("mlxrunner_example_architecture")
    # vocabulary x hidden and hidden x intermediate reach HOST_PRODUCT_MIN_SIZE
    config = dict(EXAMPLE_CONFIG, hidden_size=64, intermediate_size=1024, vocab_size=1024,
                  head_dim=16)
    return mlxrunner.load_model(write_model_folder(tmp_path_factory.mktemp("host") / "m",
                                                   config), dtype="float32")


def test_decode_steps_meeting_host_products_run_eagerly(model, monkeypatch, host_calls,
                                                        caplog):
    prompt = random_prompt(model.vocab_size, length=6)
    # this model's steps ask for less host work than a trace gives way to: traced
    check_compiled_step(model, prompt, steps=2, block=3, rounds=2)
    assert host_calls  # the prefills ran on the host
    monkeypatch.setattr(kernels, "HOST_TRACE_MIN_WORK", 1)
    compiled_steps(model).clear()
    check_compiled_step(model, prompt, steps=2, block=3, rounds=2, require_replay=False)
    steps = compiled_steps(model)
    assert steps.enabled and steps.replays() == 0
    assert logged(caplog) == ""  # a decision, not a failure
    with settings.overridden(host_products=False):  # MLX's products: the step is traced
        cache = model.make_cache()
        model(prompt, cache)
        for _ in range(3):
            forward(model, prompt[:, :1], cache)
        assert compiled_steps(model).replays() > 0


@pytest.mark.parametrize("host", [True, False])
def test_speculative_greedy_equals_plain_either_way(model, host, monkeypatch, host_calls):
    monkeypatch.setattr(kernels, "HOST_TRACE_MIN_WORK", 1)  # every forward on the host
    with settings.overridden(host_products=host):
        check_speculative_greedy(model, max_tokens=24, prompts=2, prompt_len=6)
    assert bool(host_calls) == host
