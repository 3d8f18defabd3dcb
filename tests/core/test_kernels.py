"""mlxrunner.check_kernel / outputs_agree: the first-use check of a plugin's fused kernel."""

from __future__ import annotations

import mlx.core as mx
import pytest

import mlxrunner


def test_outputs_agree_within_the_tolerance():
    want = (mx.array([1.0, -2.0, 3.0]), None)
    assert mlxrunner.outputs_agree((want[0] + 1e-4, None), want, 1e-4)
    assert not mlxrunner.outputs_agree((want[0] + 1e-2, None), want, 1e-4)
    assert not mlxrunner.outputs_agree((want[0], want[0]), want, 1e-4)  # None expected
    assert not mlxrunner.outputs_agree(want[0].astype(mx.float16), want[0], 1.0)  # dtype
    assert not mlxrunner.outputs_agree(want[0][:2], want[0], 1.0)  # shape
    assert not mlxrunner.outputs_agree([want[0]], [want[0], want[0]], 1.0)  # count


def test_check_kernel_says_why_it_refuses(capsys):
    x = mx.arange(4, dtype=mx.float32)
    assert mlxrunner.check_kernel("k", lambda: x * 2, lambda: x + x, 1e-6)
    assert capsys.readouterr().err == ""
    assert not mlxrunner.check_kernel("my kernel", lambda: x * 3, lambda: x + x, 1e-3)
    assert capsys.readouterr().err.strip() == (
        "my kernel disagrees with MLX's operations; using MLX's operations")

    def refused():
        raise ValueError("[custom_kernel] refused\nsecond line")

    assert not mlxrunner.check_kernel("my kernel", refused, lambda: x, 1e-3,
                                      against="the plain step")
    assert capsys.readouterr().err.strip() == (
        "my kernel unavailable (ValueError: [custom_kernel] refused); using the plain step")


def test_switch_allows(monkeypatch):
    variable, known = "MLXRUNNER_TEST_KERNELS", ("a", "b")
    monkeypatch.delenv(variable, raising=False)
    assert mlxrunner.switch_allows(variable, "a", known)
    for value, allowed in (("1", {"a", "b"}), ("0", set()), ("a", {"a"}), (" a,b ", {"a", "b"})):
        monkeypatch.setenv(variable, value)
        assert {n for n in known if mlxrunner.switch_allows(variable, n, known)} == allowed
    monkeypatch.setenv(variable, "a,c")  # a typo must not turn kernels off unnoticed
    with pytest.raises(mlxrunner.MLXRunnerError, match="unknown kernel 'c'"):
        mlxrunner.switch_allows(variable, "a", known)
