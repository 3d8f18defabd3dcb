"""mlxrunner.nn's Gated DeltaNet: the chunked form, the per-token block and its rollback
arrays, and the fused CUDA kernels, checked without a GPU.

- The chunked form (prompts) equals the per-token recurrence (float64 NumPy).
- The compiled block recurrence equals one-token steps, and the state it rebuilds for an
  interior boundary equals the state after that many tokens.
- Off CUDA (here) the compiled MLX operations run; a kernel that fails or disagrees in its
  self-check is never used (stand-in launchers).
- The kernel sources, run on the CPU by ``mlxrunner.testing.cuda_emulation`` (the host C++
  compiler, a thread per CUDA thread), agree with the compiled MLX operations (float32).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlxrunner.nn as mnn
import mlxrunner.nn.cuda_deltanet as cuda
import mlxrunner.nn.deltanet as dn
import mlxrunner.nn.kernels as kernels
import mlxrunner.plugin
from mlxrunner.testing.cuda_emulation import emulate_kernel, emulation_available

mx.set_default_device(mx.cpu)

DIMS = dict(hk=2, hv=4, dk=32, dv=32)  # Hk != Hv; the kernels need Dk % 32 == 0
EPS = 1e-6
KERNEL = 4


def recurrence(q, k, v, g, beta, state):
    """The gated delta rule token by token, float64, value head h reading key head h // r."""
    B, L, Hk, Dk = k.shape
    Hv = v.shape[2]
    q, k = np.repeat(q, Hv // Hk, axis=2), np.repeat(k, Hv // Hk, axis=2)
    S = state.astype(np.float64).copy()
    outs, states = [], []
    for t in range(L):
        S = S * np.exp(g[:, t])[..., None, None]
        d = beta[:, t][..., None] * (v[:, t] - np.einsum("bhvk,bhk->bhv", S, k[:, t]))
        S = S + d[..., None] * k[:, t][..., None, :]
        outs.append(np.einsum("bhvk,bhk->bhv", S, q[:, t]))
        states.append(S.copy())
    return np.stack(outs, axis=1), states


@pytest.mark.parametrize("L,Hk,Hv,chunk", [(1, 2, 2, 64), (9, 1, 3, 64), (70, 2, 4, 64),
                                           (130, 2, 2, 32), (33, 2, 4, 8)])
def test_chunked_form_matches_recurrence(L, Hk, Hv, chunk):
    rng = np.random.default_rng(L)
    B, Dk, Dv = 2, 16, 8

    def unit(x):
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    q = unit(rng.normal(size=(B, L, Hk, Dk))) / np.sqrt(Dk)
    k = unit(rng.normal(size=(B, L, Hk, Dk)))
    k[:, 1::3] = k[:, ::3][:, : k[:, 1::3].shape[1]]  # repeated keys: a hard triangular system
    v = rng.normal(size=(B, L, Hv, Dv))
    g = -np.exp(np.linspace(-6, 1, Hv)) * np.log1p(np.exp(rng.normal(size=(B, L, Hv))))
    beta = 1 / (1 + np.exp(-rng.normal(size=(B, L, Hv))))
    state = rng.normal(size=(B, Hv, Dv, Dk))
    want, states = recurrence(q, k, v, g, beta, state)
    f = [mx.array(x.astype(np.float32)) for x in (q, k, v, g, beta, state)]
    out, final, state_after = mnn.chunked_gated_delta(*f, chunk_size=chunk)
    assert np.abs(np.array(out) - want).max() < 2e-5
    assert np.abs(np.array(final) - states[-1]).max() < 2e-5
    for j in sorted({1, L // 2, L - 1} - {0}):
        assert np.abs(np.array(state_after(j)) - states[j - 1]).max() < 2e-5


def core_inputs(B: int, L: int, seed: int = 0) -> tuple[mx.array, ...]:
    """qkv, z, b, a, conv tail, state, conv weight, A_log, dt_bias, norm weight."""
    hk, hv, dk, dv = DIMS["hk"], DIMS["hv"], DIMS["dk"], DIMS["dv"]
    C = 2 * hk * dk + hv * dv
    keys = mx.random.split(mx.random.key(seed), 10)
    shapes = [(B, L, C), (B, L, hv * dv), (B, L, hv), (B, L, hv), (B, KERNEL - 1, C),
              (B, hv, dv, dk), (C, KERNEL, 1), (hv,), (hv,), (dv,)]
    arrays = [mx.random.normal(s, key=k) for s, k in zip(shapes, keys)]
    arrays[5] = 0.3 * arrays[5]  # state
    arrays[7] = mx.log(mx.random.uniform(0.05, 2.0, (hv,), key=keys[7]))  # A_log
    arrays[9] = 1.0 + 0.2 * arrays[9]  # gated norm weight
    return tuple(arrays)


def step_core(args):
    return dn.recurrent_step(*DIMS.values(), EPS)(*args)


def block_core(args):
    return dn.recurrent_block(*DIMS.values(), EPS)(*args)


def test_block_matches_steps_and_rebuilds_interior_states():
    L = 5
    args = core_inputs(2, L)
    out, tail, state, k, delta, g = block_core(args)
    t_tail, t_state = args[4], args[5]
    for t in range(L):
        one = tuple(x[:, t:t + 1] for x in args[:4])
        o, t_tail, t_state = step_core((*one, t_tail, t_state, *args[6:]))
        assert float(mx.abs(o[:, 0] - out[:, t]).max()) < 1e-5
        r_tail, r_state = dn.block_state_after(t + 1, args[4], args[5], args[0], k, delta, g)
        assert mx.array_equal(r_tail, t_tail)
        assert float(mx.abs(r_state - t_state).max()) < 1e-5
    assert mx.array_equal(tail, t_tail)
    assert float(mx.abs(state - t_state).max()) < 1e-5


def test_off_cuda_the_compiled_operations_run(monkeypatch):
    assert not kernels.kernel_allowed("deltanet")

    def launch(*a, **k):
        raise AssertionError("the CUDA kernel must not run on the CPU")

    monkeypatch.setattr(cuda, "_launch", launch)
    for L, run, core in ((1, cuda.step, step_core), (3, cuda.block, block_core)):
        args = core_inputs(1, L)
        for x, y in zip(run(args, lambda *a, core=core: core(a), *DIMS.values(), EPS),
                        core(args)):
            assert mx.array_equal(x, y)


@pytest.mark.parametrize("behaviour", ["raises", "wrong", "right"])
def test_the_self_check_gates_the_kernel(behaviour, monkeypatch, caplog):
    monkeypatch.setattr(cuda, "kernel_allowed", lambda name: True)
    monkeypatch.setattr(kernels, "_verdicts", {})
    calls = []

    def launch(kind, args, *dims, joined=None):
        calls.append(kind)
        if behaviour == "raises":
            raise RuntimeError("nvrtc: error")
        out = step_core(args)
        return (out[0], out[1], out[2] + 1.0) if behaviour == "wrong" else out

    monkeypatch.setattr(cuda, "_launch", launch)
    args = core_inputs(2, 1)
    for _ in range(2):  # one self-check per case; then the kernel only if it passed
        got = cuda.step(args, lambda *a: step_core(a), *DIMS.values(), EPS)
        for x, y in zip(got, step_core(args)):
            assert mx.array_equal(x, y)
    assert list(kernels._verdicts.values()) == [behaviour == "right"]
    assert len(calls) == (3 if behaviour == "right" else 1)
    assert ("fused deltanet kernel" in caplog.text) == (behaviour != "right")


def test_the_switch_turns_the_kernels_off(monkeypatch):
    from mlxrunner import settings

    monkeypatch.setattr(kernels, "on_cuda", lambda: True)
    assert cuda.applies(*DIMS.values())
    assert not cuda.applies(1, 2, 8, 32)  # Dk not a multiple of 32
    with settings.overridden(kernels=frozenset({"attention"})):
        assert not cuda.applies(*DIMS.values())


def _emulated(kind: str, L: int) -> None:
    B, threads = 2, 64
    hk, hv, dk, dv = DIMS.values()
    C = 2 * hk * dk + hv * dv
    template = [("T", mx.float32), *dict(
        Hk=hk, Hv=hv, Dk=dk, Dv=dv, K=KERNEL, C=C, NT=threads, EPS_E9=round(EPS * 1e9),
        P=C + hv * dv + 2 * hv, OZ=C, OB=C + hv * dv, OA=C + hv * dv + hv).items()]
    if kind == "block":
        template.append(("L", L))
    args = core_inputs(B, L, seed=L)
    # the kernels read qkv, z, b, a in place from the joined in-projection row
    joined = mx.concatenate(args[:4], axis=-1)
    names = ("proj", "conv_tail", "state", "conv_weight", "A_log", "dt_bias", "norm_weight")
    inputs = {n: np.array(x, dtype=np.float32) for n, x in zip(names, (joined, *args[4:]))}
    want = [np.array(x) for x in (step_core(args) if kind == "step" else block_core(args))]
    outputs = {n: (w.shape, np.float32) for n, w in zip(
        ("out", "new_tail", "new_state", "k_out", "delta_out", "g_out"), want)}
    source = cuda.DELTANET_STEP_SOURCE if kind == "step" else cuda.DELTANET_BLOCK_SOURCE
    got = emulate_kernel(source, inputs, outputs, template, blocks=B * hv, threads=threads)
    for (name, value), expected in zip(got.items(), want):
        assert np.abs(value - expected).max() < 2e-5, name


@pytest.mark.skipif(not emulation_available(), reason="needs a host C++ compiler (g++)")
def test_step_kernel_source_matches_the_compiled_step():
    _emulated("step", 1)


@pytest.mark.skipif(not emulation_available(), reason="needs a host C++ compiler (g++)")
@pytest.mark.parametrize("L", [1, 2, 6])
def test_block_kernel_source_matches_the_compiled_block(L: int):
    _emulated("block", L)


def test_the_layer_hands_the_kernels_the_joined_projection(monkeypatch):
    """With the kernels 'serving' (a stand-in launcher that checks its inputs and runs the
    compiled operations on what it reads back from the joined row), the layer hands each
    kernel the in-projection row whose slices are qkv, z, b, a, and gives the results of
    the compiled operations."""
    layer = mnn.GatedDeltaNet(48, DIMS["hk"], DIMS["hv"], DIMS["dk"], DIMS["dv"], KERNEL, EPS)
    mx.eval(layer.parameters())
    x = mx.random.normal((1, 7, 48), key=mx.random.key(5))
    want = [layer(x[:, :4]), layer(x[:, 4:5])]
    seen = []

    def launch(kind, args, *dims, joined=None):
        seen.append((kind, joined is not None))
        layout = dict(cuda._joined(args, None)[1])
        assert joined.shape[-1] == layout["P"]
        cuts = [0, layout["OZ"], layout["OB"], layout["OA"], layout["P"]]
        args = tuple(joined[..., a:b] for a, b in zip(cuts, cuts[1:])) + args[4:]
        return step_core(args) if kind == "step" else block_core(args)

    monkeypatch.setattr(cuda, "kernel_allowed", lambda name: True)
    monkeypatch.setattr(kernels, "_verdicts", {})
    monkeypatch.setattr(kernels, "check_kernel", lambda *a, **k: True)
    monkeypatch.setattr(cuda, "_launch", launch)
    got = [layer(x[:, :4]), layer(x[:, 4:5])]
    assert set(seen) == {("block", True), ("step", True)}
    for a, b in zip(got, want):
        assert float(mx.abs(a - b).max()) < 1e-5


def test_a_short_prompt_runs_as_kernel_blocks_and_equals_the_chunked_form(monkeypatch):
    """Where the block kernel serves, a prompt of up to SHORT_PROMPT_TOKENS tokens runs as
    blocks of BLOCK_TOKENS through it (a stand-in launcher running the compiled operations
    here): outputs and the cache's state equal the chunked form's, which runs otherwise."""
    layer = mnn.GatedDeltaNet(48, DIMS["hk"], DIMS["hv"], DIMS["dk"], DIMS["dv"], KERNEL, EPS)
    mx.eval(layer.parameters())
    x = mx.random.normal((2, 3 + 37, 48), key=mx.random.key(6))

    def run():
        cache = mlxrunner.plugin.RecurrentCache()
        first = layer(x[:, :3], cache)
        rest = layer(x[:, 3:], cache)
        return [first, rest, cache.conv_tail, cache.recurrent_state], cache.offset

    want, want_offset = run()
    kinds = []

    def launch(kind, args, *dims, joined=None):
        kinds.append((kind, args[0].shape[1]))
        return step_core(args) if kind == "step" else block_core(args)

    monkeypatch.setattr(cuda, "kernel_allowed", lambda name: True)
    monkeypatch.setattr(kernels, "_verdicts", {})
    monkeypatch.setattr(kernels, "check_kernel", lambda *a, **k: True)
    monkeypatch.setattr(cuda, "_launch", launch)
    got, offset = run()
    # the 3-token forward is one block; the 37 tokens three (16, 16, 5), none chunked
    assert kinds == [("block", 3), ("block", 16), ("block", 16), ("block", 5)]
    assert offset == want_offset == 40
    for a, b in zip(got, want):
        assert float(mx.abs(a - b).max()) < 1e-5
