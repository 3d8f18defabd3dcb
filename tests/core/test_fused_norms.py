"""mlxrunner.nn.attention_heads and RMSNorm.add_normed: each head's norm, RoPE and layout in
one kernel, and a post-norm's residual add in one, against MLX's operations (the kernel
cases need MLX's CUDA backend; off it, the layers' results are MLX's own)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

import mlxrunner.nn as mnn
from mlxrunner.nn import cuda_norms, kernels
from mlxrunner_test_support import on_cuda_and_emulated

on_cuda, emulated = on_cuda_and_emulated()


def _close(got: mx.array, want: mx.array, dtype: mx.Dtype) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = (1e-5 if dtype == mx.float32 else 2e-2) * (1.0 + float(mx.abs(want.astype(
        mx.float32)).max()))
    np.testing.assert_allclose(np.array(got.astype(mx.float32)),
                               np.array(want.astype(mx.float32)), rtol=0, atol=tol)


def _parts(dtype: mx.Dtype, B: int, L: int, D: int, seed: int = 0):
    keys = [mx.random.key(seed + i) for i in range(5)]
    q = (2 * mx.random.normal((B, L, 4, D), key=keys[0])).astype(dtype)
    k = (2 * mx.random.normal((B, L, 2, D), key=keys[1])).astype(dtype)
    v = (2 * mx.random.normal((B, L, 2, D), key=keys[2])).astype(dtype)
    q_norm, k_norm = mnn.RMSNorm(D, 1e-6), mnn.RMSNorm(D, 1e-6, offset=1.0)
    q_norm.weight = (1 + 0.2 * mx.random.normal((D,), key=keys[3])).astype(dtype)
    k_norm.weight = (0.2 * mx.random.normal((D,), key=keys[4])).astype(dtype)
    return q, k, v, q_norm, k_norm


def _by_hand(offset, q, k, v, q_norm, k_norm, rope):
    def one(x, w, eps, rotate):
        x = mx.fast.rms_norm(x, w, eps).transpose(0, 2, 1, 3)
        return rope(x, offset) if rotate else x
    return [one(q, q_norm.weight, 1e-6, True),
            one(k, (k_norm.weight.astype(mx.float32) + 1).astype(k.dtype), 1e-6, True),
            one(v, None, 1e-5, False)]


def test_off_cuda_the_parts_are_the_layers_own_operations():
    if kernels.on_cuda():
        pytest.skip("on CUDA the kernels serve")
    q, k, v, q_norm, k_norm = _parts(mx.float32, 1, 3, 64)
    rope = mnn.RoPE(32, base=10000.0)
    got = mnn.attention_heads(5, (q, q_norm, rope), (k, k_norm, rope), (v, 1e-5, None))
    for g, w in zip(got, _by_hand(5, q, k, v, q_norm, k_norm, rope)):
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-5, atol=1e-5)
    assert cuda_norms.fused_heads([(q, None, None, False)], None, 0) is None
    norm = mnn.RMSNorm(64, 1e-5)
    norm.weight = 1 + 0.1 * mx.random.normal((64,), key=mx.random.key(9))
    r, x, s = q[:, :, 0], k[:, :, 0], mx.array([0.5])
    want = (r + mx.fast.rms_norm(x, norm.weight, 1e-5)) * s
    np.testing.assert_allclose(np.array(norm.add_normed(r, x, s)), np.array(want),
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.array(norm.add_normed(r, x)),
                               np.array(r + mx.fast.rms_norm(x, norm.weight, 1e-5)),
                               rtol=1e-6, atol=1e-6)


def test_heads_not_shaped_as_heads_get_one_clear_error():
    rope = mnn.RoPE(8, base=10000.0)
    with pytest.raises(ValueError, match=r"part 0's heads must be \[B, L, H, D\].*\[1, 2, 8\]"):
        mnn.attention_heads(0, (mx.zeros((1, 2, 8)), mnn.RMSNorm(8), rope))
    with pytest.raises(ValueError, match="part 1's heads"):
        mnn.attention_heads(0, (mx.zeros((1, 2, 4, 8)), None, rope),
                            (mx.zeros((1, 3, 1, 8)), None, rope))
    with pytest.raises(ValueError, match="part 0 takes 16 of heads of 8"):
        mnn.attention_heads(0, (mx.zeros((1, 2, 4, 8)), None, rope, 16))
    with pytest.raises(ValueError, match="part 0 takes '4' of heads of 8"):
        mnn.attention_heads(0, (mx.zeros((1, 2, 4, 8)), None, rope, "4"))
    with pytest.raises(ValueError, match=r"part 1 takes slice\(0, 8, 2\) of heads of 8"):
        mnn.attention_heads(0, (mx.zeros((1, 2, 4, 8)), None, rope),
                            (mx.zeros((1, 2, 4, 8)), None, None, slice(0, 8, 2)))


def test_a_size_takes_each_heads_leading_entries():
    q, k, v, q_norm, k_norm = _parts(mx.float32, 2, 1, 32)
    rope = mnn.RoPE(16, base=10000.0)
    q_gate = mx.concatenate([q, 5 * q + 1], axis=-1)
    got_q, got_k, gate = mnn.attention_heads(7, (q_gate, q_norm, rope, 32), (k, k_norm, rope),
                                             (q_gate, None, None, slice(32, None)))
    want = _by_hand(7, q, k, v, q_norm, k_norm, rope)
    _close(got_q, want[0], mx.float32)
    _close(got_k, want[1], mx.float32)
    _close(gate, (5 * q + 1).transpose(0, 2, 1, 3), mx.float32)


ROPES = {
    "base": lambda D: mnn.RoPE(D, base=10000.0),
    "partial": lambda D: mnn.RoPE(D // 4, base=1e7),
    "traditional": lambda D: mnn.RoPE(D, base=500000.0, traditional=True),
    "scaled": lambda D: mnn.RoPE(D, base=10000.0, scale=0.25),
    "proportional": lambda D: mnn.RoPE(D, freqs=mnn.rope.proportional_periods(D, 1e6, 0.25)),
    "llama3": lambda D: mnn.RoPE.from_config(D, {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}}),
}


@on_cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("B,L,D", [(1, 1, 256), (1, 1, 512), (3, 1, 128), (2, 4, 64),
                                   (1, 37, 256)])
def test_heads_match_mlx_operations_on_the_gpu(dtype, rope, B, L, D):
    mx.set_default_device(mx.gpu)
    q, k, v, q_norm, k_norm = _parts(dtype, B, L, D, seed=D + B)
    r = ROPES[rope](D)
    for offset in (0, 4093, mx.array(77, dtype=mx.int32),
                   mx.array([3, 1000, 20000][:B], dtype=mx.int32)):
        parts = ((q, q_norm, r), (k, k_norm, r), (v, 1e-5, None))
        kernel_parts = [(q, q_norm.applied_weight(), 1e-6, True),
                        (k, k_norm.applied_weight(), 1e-6, True), (v, None, 1e-5, False)]
        rotation = (r.dims, r.traditional, None if r.freqs is not None else
                    math.log2(r.base), r.scale, r.freqs)
        assert cuda_norms.fused_heads(kernel_parts, rotation, offset) is not None, \
            "the kernel should serve this case"
        got = mnn.attention_heads(offset, *parts)
        for g, w in zip(got, _by_hand(offset, q, k, v, q_norm, k_norm, r)):
            _close(g, w, dtype)
        # one part alone, without a norm
        alone, = mnn.attention_heads(offset, (q, None, r))
        _close(alone, r(q.transpose(0, 2, 1, 3), offset), dtype)
        # the halves of wider heads (a query ahead of its gate), read in place
        q_gate = mx.concatenate([q, 3 * q - 1], axis=-1)
        query, gate = mnn.attention_heads(offset, (q_gate, q_norm, r, D),
                                          (q_gate, None, None, slice(D, None)))
        _close(query, _by_hand(offset, q, k, v, q_norm, k_norm, r)[0], dtype)
        _close(gate, q_gate[..., D:].transpose(0, 2, 1, 3), dtype)


@on_cuda
def test_heads_in_a_compiled_step_follow_the_offset_on_the_gpu():
    mx.set_default_device(mx.gpu)
    q, k, v, q_norm, k_norm = _parts(mx.bfloat16, 1, 1, 256, seed=5)
    r = mnn.RoPE(256, base=10000.0)
    step = mx.compile(lambda o: mnn.attention_heads(o, (q, q_norm, r), (k, k_norm, r),
                                                    (v, 1e-5, None)))
    for position in (0, 1, 513):
        offset = mx.array(position, dtype=mx.int32)
        for g, w in zip(step(offset), _by_hand(offset, q, k, v, q_norm, k_norm, r)):
            _close(g, w, mx.bfloat16)


@on_cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("rows,D", [(1, 1536), (4, 2560), (2, 100)])
def test_add_normed_matches_mlx_operations_on_the_gpu(dtype, rows, D):
    mx.set_default_device(mx.gpu)
    keys = [mx.random.key(D + rows + i) for i in range(4)]
    r = mx.random.normal((rows, 1, D), key=keys[0]).astype(dtype)
    x = (5 * mx.random.normal((rows, 1, D), key=keys[1])).astype(dtype)
    norm = mnn.RMSNorm(D, 1e-6)
    norm.weight = (1 + 0.1 * mx.random.normal((D,), key=keys[2])).astype(dtype)
    s = mx.array([0.71], dtype=dtype)
    for scale in (None, s):
        assert cuda_norms.fused_add_norm(r, x, norm.weight, 1e-6, scale) is not None
        want = r + mx.fast.rms_norm(x, norm.weight, 1e-6)
        _close(norm.add_normed(r, x, scale), want if scale is None else want * scale, dtype)
    # a prompt's rows: one launch too, the same result
    prompt_r, prompt_x = mx.tile(r, (1, 80, 1)), mx.tile(x, (1, 80, 1))
    assert cuda_norms.fused_add_norm(prompt_r, prompt_x, norm.weight, 1e-6, s) is not None
    for scale in (None, s):
        want = prompt_r + mx.fast.rms_norm(prompt_x, norm.weight, 1e-6)
        _close(norm.add_normed(prompt_r, prompt_x, scale),
               want if scale is None else want * scale, dtype)




def _rope_np(x, positions, dims, traditional, inv_freq):
    """Rotate ``x [..., L, D]``'s first ``dims`` at ``positions [..., L]`` (numpy)."""
    out = x.copy()
    theta = positions[..., None] * inv_freq  # [..., L, dims/2]
    c, s = np.cos(theta), np.sin(theta)
    if traditional:
        a, b = x[..., 0:dims:2], x[..., 1:dims:2]
        out[..., 0:dims:2], out[..., 1:dims:2] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., :dims // 2], x[..., dims // 2:dims]
        out[..., :dims // 2], out[..., dims // 2:dims] = a * c - b * s, a * s + b * c
    return out


@emulated
@pytest.mark.parametrize("B,L,freqs,traditional,dims,wide,parts", [
    (1, 1, False, False, 32, 0, 3), (2, 2, True, False, 16, 32, 3), (3, 1, False, True, 32, 6, 3),
    (2, 1, False, False, 32, 6, 1), (1, 2, True, True, 16, 0, 1), (1, 7, False, False, 32, 6, 3)])
def test_the_heads_kernel_computes_its_math_in_emulation(B, L, freqs, traditional, dims, wide,
                                                         parts):
    """Three parts (weighted norm, rotated; weighted, rotated; weightless, not rotated),
    positions per sequence, a partial rotation, periods given or from the base; the first
    part's heads ``wide`` entries wider than the D taken, from entry ``wide // 2`` on. One
    part (a layer's queries alone): the others' inputs and outputs absent, as the core
    launches it, and the periods absent where they come from the base. Past
    ``MAX_HEAD_POSITIONS`` (one sequence's prompt rows) the length is not a constant of the
    kernel but the launch's rows, as the core launches it."""
    from mlxrunner.testing.cuda_emulation import emulate_kernel

    rng = np.random.default_rng(B * 10 + L)
    D, heads, eps = 32, (3, 1, 1), np.array([1e-6, 1e-5, 1e-4], np.float32)
    xs = [rng.normal(size=(B, L, h, D + (wide if i == 0 else 0))).astype(np.float32) * 2
          for i, h in enumerate(heads)]
    ws = [(1 + 0.1 * rng.normal(size=D)).astype(np.float32) for _ in range(2)]
    offsets = np.array([5, 300, 7000][:B], np.int32)
    base, scale = 10000.0, 0.5
    half = np.arange(dims // 2, dtype=np.float32)
    periods = (base ** (2 * half / dims) * 3).astype(np.float32)
    inv_freq = 1 / periods if freqs else 2.0 ** (-(half / (dims // 2)) * math.log2(base))
    whole = parts == 3
    template = [("T", mx.float32), ("D", D), ("H0", 3), ("H1", 1 if whole else 0),
                ("H2", 1 if whole else 0), ("W0", D + wide), ("W1", D), ("W2", D),
                ("C0", wide // 2), ("C1", 0), ("C2", 0), ("NORM0", 2),
                ("NORM1", 2 if whole else 0), ("NORM2", 1 if whole else 0), ("ROT0", True),
                ("ROT1", whole), ("ROT2", False),
                ("RD", dims), ("TRAD", traditional), ("FREQS", freqs),
                ("L", L if L <= cuda_norms.MAX_HEAD_POSITIONS else 0),
                ("PERB", B > 1), ("NT", cuda_norms.HEAD_THREADS)]
    got = emulate_kernel(  # (None: absent, as the core launches it)
        cuda_norms.HEADS_SOURCE,
        {"x0": xs[0], "x1": xs[1] if whole else None, "x2": xs[2] if whole else None,
         "w0": ws[0], "w1": ws[1] if whole else None, "w2": None, "eps": eps,
         "offset": offsets, "freqs": periods if freqs else None,
         "rf": np.array([math.log2(base), scale], np.float32)},
        {f"y{i}": ((B, h, L, D), np.float32) if whole or i == 0 else None
         for i, h in enumerate(heads)}, template,
        blocks=B * L * sum(heads[:parts]), threads=cuda_norms.HEAD_THREADS)
    assert sorted(got) == [f"y{i}" for i in range(parts)]
    positions = scale * (offsets[:, None] + np.arange(L))[:, None, :]  # [B, 1, L]
    for i, x in enumerate(xs[:parts]):
        x = x[..., wide // 2:wide // 2 + D] if i == 0 else x
        n = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps[i])
        n = (n * ws[i] if i < 2 else n).transpose(0, 2, 1, 3)
        want = _rope_np(n, positions, dims, traditional, inv_freq) if i < 2 else n
        np.testing.assert_allclose(got[f"y{i}"], want, rtol=1e-4, atol=1e-4, err_msg=f"part {i}")


@emulated
@pytest.mark.parametrize("scale", [False, True])
def test_the_add_norm_kernel_computes_its_math_in_emulation(scale):
    from mlxrunner.testing.cuda_emulation import emulate_kernel

    rng = np.random.default_rng(int(scale))
    rows, D = 3, 300  # not a whole number of passes of the block's threads
    x = (4 * rng.normal(size=(rows, D))).astype(np.float32)
    r = rng.normal(size=(rows, D)).astype(np.float32)
    w = (1 + 0.1 * rng.normal(size=D)).astype(np.float32)
    s = np.array([0.7], np.float32)
    got = emulate_kernel(
        cuda_norms.ADD_NORM_SOURCE,
        {"x": x, "w": w, "res": r, "s": s if scale else None, "eps": np.array([1e-6], np.float32)},
        {"y": ((rows, D), np.float32)},
        [("T", mx.float32), ("D", D), ("NT", cuda_norms.ADD_THREADS), ("SCALE", scale)],
        blocks=rows, threads=cuda_norms.ADD_THREADS)["y"]
    want = r + x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(got, want * s if scale else want, rtol=1e-5, atol=1e-5)
