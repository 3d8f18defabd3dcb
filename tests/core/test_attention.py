"""mlxrunner.attend: the folded grouped-query attention equals MLX's fused function."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlxrunner
from mlxrunner import attention


def _case(B, Hq, Hk, L, S, D, Dv, dtype, seed=0):
    keys = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((B, Hq, L, D), key=keys[0]).astype(dtype)
    k = mx.random.normal((B, Hk, S, D), key=keys[1]).astype(dtype)
    v = mx.random.normal((B, Hk, S, Dv), key=keys[2]).astype(dtype)
    return q, k, v


def _masks(L, S):
    rows = mx.arange(L)[:, None]
    cols = mx.arange(S)[None]
    return {"none": None,
            "block": cols <= (S - L) + rows,  # a verify block at the end of the buffer
            "vector": mx.arange(S) % 3 != 1,  # one row for every query
            "ring": (cols > rows) & (cols <= rows + S - L)}


@pytest.mark.parametrize("Hq,Hk", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("L", [1, 3, 8])
@pytest.mark.parametrize("mask", ["none", "block", "vector", "ring"])
def test_folded_equals_mlx_float32(Hq, Hk, L, mask):
    q, k, v = _case(2, Hq, Hk, L, 40, 32, 16, mx.float32, seed=L)
    m = _masks(L, 40)[mask]
    got = attention.folded_attention(q, k, v, scale=0.3, mask=m)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=m)
    assert got.shape == want.shape == (2, Hq, L, 16)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


def test_folded_equals_mlx_bfloat16():
    q, k, v = _case(1, 8, 2, 4, 300, 64, 64, mx.bfloat16, seed=5)
    m = _masks(4, 300)["block"]
    got = attention.folded_attention(q, k, v, scale=64 ** -0.5, mask=m)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=64 ** -0.5, mask=m)
    assert got.dtype == mx.bfloat16
    np.testing.assert_allclose(np.array(got.astype(mx.float32)),
                               np.array(want.astype(mx.float32)), rtol=2e-2, atol=2e-2)


def test_a_masked_key_is_not_seen():
    q, k, v = _case(1, 2, 1, 1, 6, 8, 8, mx.float32)
    mask = mx.array([True, True, False, True, True, True])
    changed = mx.concatenate([v[:, :, :2], v[:, :, 2:3] + 100.0, v[:, :, 3:]], axis=2)
    a = attention.folded_attention(q, k, v, scale=1.0, mask=mask)
    b = attention.folded_attention(q, k, changed, scale=1.0, mask=mask)
    assert mx.array_equal(a, b)
    assert not mx.array_equal(attention.folded_attention(q, k, changed, scale=1.0),
                              attention.folded_attention(q, k, v, scale=1.0))


def test_attend_folds_only_short_blocks_on_cuda(monkeypatch):
    q, k, v = _case(1, 4, 2, 2, 10, 8, 8, mx.float32)
    mask = _masks(2, 10)["block"]
    calls = []
    real = attention.folded_attention

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "folded_attention", spy)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5, mask=mask)
    assert mx.allclose(mlxrunner.attend(q, k, v, scale=0.5, mask=mask), want)
    assert calls == []  # not CUDA: MLX's function
    monkeypatch.setattr(attention, "_cuda_default", lambda: True)
    assert mx.allclose(mlxrunner.attend(q, k, v, scale=0.5, mask=mask), want, atol=1e-5)
    assert calls == [(1, 4, 2, 8)]
    mlxrunner.attend(q, k, v, scale=0.5, mask="causal")  # a string mask: MLX's function
    long_q = mx.zeros((1, 4, attention.FOLD_MAX_QUERIES + 1, 8))
    mlxrunner.attend(long_q, mx.zeros((1, 2, 40, 8)), mx.zeros((1, 2, 40, 8)), scale=0.5)
    monkeypatch.setenv(attention.ENV_SWITCH, "0")
    mlxrunner.attend(q, k, v, scale=0.5, mask=mask)
    assert calls == [(1, 4, 2, 8)]
