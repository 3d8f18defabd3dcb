"""The fused CUDA DeltaNet step, checked without a GPU.

- Dispatch: off the CUDA backend (here) the pure-MLX step runs; on CUDA a kernel that
  fails or disagrees in its self-check is disabled and the pure-MLX step runs instead
  (exercised with stand-in launchers).
- Logic: the kernel sources run on the CPU under ``mlxrunner.testing.cuda_emulation`` (the
  host C++ compiler, a thread per CUDA thread, barriers for __syncthreads and warp
  shuffles) and are compared with MLX's operations, float32. This checks the indexing and
  the arithmetic; CUDA-only details (bf16 conversions, nvrtc) are left to the GPU run,
  where the self-check guards them.
"""

from __future__ import annotations

import mlx.core as mx
import mlxrunner_qwen3_5.cuda_kernels as ck
import mlxrunner_qwen3_5.model as qm
import numpy as np
import pytest

from mlxrunner.testing.cuda_emulation import emulate_kernel, emulation_available


@pytest.fixture
def on_gpu():
    """The GPU as the default device for one test (other test modules here set the CPU)."""
    previous = mx.default_device()
    mx.set_default_device(mx.gpu)
    yield
    mx.set_default_device(previous)


mx.set_default_device(mx.cpu)

DIMS = dict(hk=2, hv=4, dk=32, dv=32)  # Hk != Hv; the kernel needs Dk % 32 == 0
EPS = 1e-6
KERNEL = 4


def step_inputs(B: int = 2, seed: int = 0) -> tuple[mx.array, ...]:
    hk, hv, dk, dv = DIMS["hk"], DIMS["hv"], DIMS["dk"], DIMS["dv"]
    C = 2 * hk * dk + hv * dv
    keys = mx.random.split(mx.random.key(seed), 10)
    shapes = [(B, 1, C), (B, 1, hv * dv), (B, 1, hv), (B, 1, hv), (B, KERNEL - 1, C),
              (B, hv, dv, dk), (C, KERNEL, 1), (hv,), (hv,), (dv,)]
    arrays = [mx.random.normal(s, key=k) for s, k in zip(shapes, keys)]
    arrays[5] = 0.3 * arrays[5]  # state
    arrays[7] = mx.log(mx.random.uniform(0.05, 2.0, (hv,), key=keys[7]))  # A_log
    arrays[9] = 1.0 + 0.2 * arrays[9]  # gated norm weight
    return tuple(arrays)


def pure_mlx(args: tuple[mx.array, ...]) -> tuple[mx.array, ...]:
    return qm._decode_step(DIMS["hk"], DIMS["hv"], DIMS["dk"], DIMS["dv"], EPS)(*args)


def test_cpu_uses_the_pure_mlx_step():
    assert not ck.cuda_backend()
    assert not ck.applies(**DIMS)
    args = step_inputs()

    def launch(*a, **k):
        raise AssertionError("the CUDA kernel must not run on the CPU")

    got = ck.deltanet_step(args, lambda *a: pure_mlx(a), *DIMS.values(), EPS, launch=launch)
    for x, y in zip(got, pure_mlx(args)):
        assert mx.array_equal(x, y)


@pytest.mark.parametrize("behaviour", ["raises", "wrong", "right"])
def test_self_check_gates_the_kernel(behaviour, monkeypatch):
    monkeypatch.setattr(ck, "applies", lambda *a: True)
    monkeypatch.setattr(ck, "_verdicts", {})
    calls = []

    def launch(args, *dims):
        calls.append(len(calls))
        if behaviour == "raises":
            raise RuntimeError("nvrtc: error")
        out = pure_mlx(args)
        if behaviour == "wrong":
            return (out[0], out[1], out[2] + 1.0)
        return out

    args = step_inputs()
    for _ in range(2):  # the verdict is kept: one self-check per shape and dtype
        got = ck.deltanet_step(args, lambda *a: pure_mlx(a), *DIMS.values(), EPS, launch=launch)
        for x, y in zip(got, pure_mlx(args)):
            assert mx.array_equal(x, y)
    assert len(ck._verdicts) == 1
    assert list(ck._verdicts.values()) == [behaviour == "right"]
    # self-check once, then the kernel on every call only when it passed
    assert len(calls) == (3 if behaviour == "right" else 1)


def test_switch_turns_the_kernel_off(monkeypatch):
    monkeypatch.setattr(ck, "cuda_backend", lambda: True)
    assert ck.applies(**DIMS)
    assert not ck.applies(1, 2, 8, 32)  # Dk not a multiple of 32
    monkeypatch.setenv(ck.ENV_SWITCH, "0")
    assert not ck.applies(**DIMS)


@pytest.mark.skipif(not emulation_available(), reason="needs a host C++ compiler (g++)")
def test_kernel_source_matches_the_pure_mlx_step():
    B, threads = 2, 64
    hk, hv, dk, dv = DIMS["hk"], DIMS["hv"], DIMS["dk"], DIMS["dv"]
    C = 2 * hk * dk + hv * dv
    template = [("T", mx.float32), *dict(
        Hk=hk, Hv=hv, Dk=dk, Dv=dv, K=KERNEL, C=C, NT=threads, EPS_E9=round(EPS * 1e9),
        P=C + hv * dv + 2 * hv, OZ=C, OB=C + hv * dv, OA=C + hv * dv + hv).items()]
    args = step_inputs(B)
    # the kernel reads qkv, z, b, a in place from the joined in-projection row
    joined = mx.concatenate(args[:4], axis=-1)
    names = ("proj", "conv_tail", "state", "conv_weight", "A_log", "dt_bias", "norm_weight")
    inputs = {n: np.array(x, dtype=np.float32) for n, x in zip(names, (joined, *args[4:]))}
    want = [np.array(x) for x in pure_mlx(args)]
    outputs = {n: (w.shape, np.float32) for n, w in zip(("out", "new_tail", "new_state"), want)}
    got = emulate_kernel(ck.DELTANET_STEP_SOURCE, inputs, outputs, template,
                         blocks=B * hv, threads=threads)
    for (name, value), expected in zip(got.items(), want):
        assert np.abs(value - expected).max() < 2e-5, name


# -- attention: the fused q/k norm and RoPE kernel -----------------------------------------------


def _attention(heads: int = 2, kv_heads: int = 1, head_dim: int = 64):
    cfg = qm.Qwen3_5Config.from_dict({
        "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": 16,
        "intermediate_size": 16, "layer_types": ["full_attention"],
        "linear_num_key_heads": 1, "linear_num_value_heads": 1, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "rope_parameters": {"rope_theta": 10000.0,
                                                          "partial_rotary_factor": 0.25}})
    attn = qm.Attention(cfg)
    keys = mx.random.split(mx.random.key(3), 2)
    attn.q_norm.weight = 1 + 0.2 * mx.random.normal((head_dim,), key=keys[0])
    attn.k_norm.weight = 1 + 0.2 * mx.random.normal((head_dim,), key=keys[1])
    return attn


@pytest.mark.skipif(not emulation_available(), reason="needs a host C++ compiler (g++)")
@pytest.mark.parametrize("B,L,position", [(1, 1, 0), (1, 1, 517), (2, 3, 40)])
def test_qk_kernel_source_computes_norm_and_rope_on_the_cpu(B, L, position):
    """The q/k kernel body under the host emulation (float32) equals MLX's q_norm/k_norm
    and partial RoPE, for every head of every row, at several positions."""
    attn = _attention()
    H, Hk, D, R = attn.heads, attn.kv_heads, attn.head_dim, attn.rotary_dims
    width = (2 * H + 2 * Hk) * D
    rows = mx.random.normal((B * L, width), key=mx.random.key(B * 100 + L))
    pos = mx.array([position], dtype=mx.int32)
    want_q, want_k = attn._norm_rope(attn._heads(rows, B, L)[0][:, 0::2],
                                     attn._heads(rows, B, L)[1], pos)
    got = emulate_kernel(
        ck.QK_NORM_ROPE_SOURCE,
        {"rows": np.array(rows), "q_weight": np.array(attn.q_norm.weight),
         "k_weight": np.array(attn.k_norm.weight),
         "inv_freq": np.array(qm._inv_freq(R, attn.rope_theta)),
         "position": np.array(pos), "seq": np.array([L], np.int32)},
        {"q_out": ((B, H, L, D), np.float32), "k_out": ((B, Hk, L, D), np.float32)},
        [("T", mx.float32), ("H", H), ("HK", Hk), ("D", D), ("R", R),
         ("P", width), ("NT", D), ("EPS_E9", 1000)], blocks=B * L * (H + Hk), threads=D)
    np.testing.assert_allclose(got["q_out"], np.array(want_q), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got["k_out"], np.array(want_k), rtol=1e-4, atol=1e-4)


def test_qk_kernel_is_gated_and_falls_back(monkeypatch, caplog):
    """Off CUDA the MLX operations run; on CUDA a kernel that fails its self-check stays
    off (one warning) and the forward is unchanged."""
    attn = _attention()
    x = mx.random.normal((1, 1, 32), key=mx.random.key(0))
    monkeypatch.setattr(ck, "cuda_backend", lambda: False)  # MLX's operations
    want = attn._project(x, 5, 1, 1)
    monkeypatch.setattr(ck, "cuda_backend", lambda: True)
    monkeypatch.setattr(ck, "_qk_verdicts", {})

    def broken(*args, **kwargs):
        raise ValueError("[custom_kernel] refused")

    monkeypatch.setattr(ck, "_qk_launch", broken)
    for _ in range(2):
        got = attn._project(x, 5, 1, 1)
        for a, b in zip(got, want):
            assert mx.array_equal(a, b)
    assert caplog.text.count("fused q/k norm kernel unavailable") == 1  # logged
    flat = mx.zeros((65, 6 * 64))
    assert not ck._qk_applies(flat, attn._qk_dims(), 65, 1)  # prompts keep MLX's operations


@pytest.mark.skipif(not (hasattr(mx, "cuda") and mx.cuda.is_available()),
                    reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("B,L", [(1, 1), (1, 8), (4, 1)])
def test_qk_kernel_matches_mlx_operations(on_gpu, dtype, B, L):
    attn = _attention(heads=8, kv_heads=2, head_dim=256)
    attn.set_dtype(dtype)
    width = (2 * attn.heads + 2 * attn.kv_heads) * attn.head_dim
    rows = mx.random.normal((B * L, width), key=mx.random.key(L)).astype(dtype)
    pos = mx.array(300, dtype=mx.int32)  # 0-d for MLX's rope (see qk_norm_rope_usable)
    got = ck._qk_launch(rows, attn.q_norm.weight, attn.k_norm.weight,
                        qm._inv_freq(attn.rotary_dims, attn.rope_theta), pos.reshape(1),
                        attn._qk_dims(), B, L)
    heads = attn._heads(rows, B, L)
    want = attn._norm_rope(heads[0][:, 0::2], heads[1], pos)
    tolerance = 1e-4 if dtype == mx.float32 else 3e-2
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.array(a.astype(mx.float32)),
                                   np.array(b.astype(mx.float32)),
                                   rtol=tolerance, atol=tolerance)


def test_kernel_switch(monkeypatch):
    """The plugin's kernels answer to its switch, and only on CUDA."""
    monkeypatch.setattr(ck, "cuda_backend", lambda: True)
    monkeypatch.setenv(ck.ENV_SWITCH, "deltanet")
    assert ck.kernel_on("deltanet") and not ck.kernel_on("qk")
    monkeypatch.delenv(ck.ENV_SWITCH)
    assert ck.kernel_on("deltanet") and ck.kernel_on("qk")
    monkeypatch.setattr(ck, "cuda_backend", lambda: False)
    assert not ck.kernel_on("deltanet")
