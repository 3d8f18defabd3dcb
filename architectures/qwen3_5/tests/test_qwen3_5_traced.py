"""Traced short forwards (decode steps, verify blocks) and the fused block kernel.

- A traced forward through filled caches (one ``mx.compile`` call per length) gives the
  eager forward's logits, taps and caches, and its snapshots restore like the eager ones.
- The block recurrence (pure MLX) agrees with the chunked form, and the state it rebuilds
  for an interior boundary equals the state after that many tokens.
- The CUDA block kernel's source, run on the CPU by ``mlxrunner.testing.cuda_emulation``,
  agrees with the pure-MLX block (float32).
"""

from __future__ import annotations

import mlx.core as mx
import mlxrunner_qwen3_5.cuda_kernels as ck
import mlxrunner_qwen3_5.model as qm
import numpy as np
import pytest

from mlxrunner.testing.cuda_emulation import emulate_kernel, emulation_available

mx.set_default_device(mx.cpu)

NAME = "tiny_hk2_hv4_tied"  # 3 DeltaNet layers (Hk 2, Hv 4) + 1 full-attention layer
VOCAB = 256
DIMS = dict(hk=2, hv=4, dk=32, dv=32)
EPS = 1e-6
KERNEL = 4


def _run(model, tokens: np.ndarray, traced: bool, taps=None):
    model.compile_steps = traced
    caches = model.make_cache()
    outs = [model(mx.array(tokens[:, :9]), caches)]
    outs.append(model(mx.array(tokens[:, 9:10]), caches, taps=taps))  # a decode step
    outs.append(model(mx.array(tokens[:, 10:15]), caches, taps=taps))  # a short block
    for c in caches:
        c.schedule_snapshots(range(16, 22))
    outs.append(model(mx.array(tokens[:, 15:21]), caches, taps=taps))  # a verify block
    for c in caches:
        c.restore(18)
    outs.append(model(mx.array(tokens[:, 18:19]), caches, taps=taps))
    outs.append(model(mx.array(tokens[:, 19:21]), caches))
    model.compile_steps = True
    return outs, caches


@pytest.mark.parametrize("batch", [1, 2])
def test_traced_forwards_equal_eager(fixture_model, batch):
    model = fixture_model(NAME)
    tokens = np.random.default_rng(batch).integers(0, VOCAB, (batch, 24)).astype(np.int32)
    taps = [2, 0]
    traced, traced_caches = _run(model, tokens, True, taps)
    model._steps.clear()
    eager, eager_caches = _run(model, tokens, False, taps)
    assert model._steps == {}
    for got, want in zip(traced, eager):
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        for x, y in zip(got, want):
            assert x.shape == y.shape
            assert float(mx.abs(x - y).max()) < 1e-4
    for a, b in zip(traced_caches, eager_caches):
        assert a.offset == b.offset == 21
        n = a.offset
        pairs = ([(a.conv_tail, b.conv_tail), (a.recurrent_state, b.recurrent_state)]
                 if isinstance(a, qm.RecurrentCache) else
                 [(a.keys[..., :n, :], b.keys[..., :n, :]),
                  (a.values[..., :n, :], b.values[..., :n, :])])
        for x, y in pairs:
            assert float(mx.abs(x - y).max()) < 1e-4


def test_traced_forwards_are_reused(fixture_model):
    model = fixture_model(NAME)
    model._steps.clear()
    tokens = np.random.default_rng(3).integers(0, VOCAB, (1, 30)).astype(np.int32)
    caches = model.make_cache()
    model(mx.array(tokens[:, :20]), caches)  # a prompt: eager
    assert model._steps == {}
    for i in range(20, 25):
        model(mx.array(tokens[:, i:i + 1]), caches)
    assert list(model._steps) == [(None, 1, False)]


def block_inputs(B: int, L: int, seed: int = 0) -> tuple[mx.array, ...]:
    hk, hv, dk, dv = DIMS["hk"], DIMS["hv"], DIMS["dk"], DIMS["dv"]
    C = 2 * hk * dk + hv * dv
    keys = mx.random.split(mx.random.key(seed), 10)
    shapes = [(B, L, C), (B, L, hv * dv), (B, L, hv), (B, L, hv), (B, KERNEL - 1, C),
              (B, hv, dv, dk), (C, KERNEL, 1), (hv,), (hv,), (dv,)]
    arrays = [mx.random.normal(s, key=k) for s, k in zip(shapes, keys)]
    arrays[5] = 0.3 * arrays[5]
    arrays[7] = mx.log(mx.random.uniform(0.05, 2.0, (hv,), key=keys[7]))
    arrays[9] = 1.0 + 0.2 * arrays[9]
    return tuple(arrays)


def pure_block(args):
    return qm._block_step(DIMS["hk"], DIMS["hv"], DIMS["dk"], DIMS["dv"], EPS)(*args)


def test_block_recurrence_matches_steps_and_rebuilds_interior_states():
    L = 5
    args = block_inputs(2, L)
    out, tail, state, k, delta, g = pure_block(args)
    step = qm._decode_step(DIMS["hk"], DIMS["hv"], DIMS["dk"], DIMS["dv"], EPS)
    t_tail, t_state = args[4], args[5]
    for t in range(L):
        one = tuple(x[:, t:t + 1] for x in args[:4])
        o, t_tail, t_state = step(*one, t_tail, t_state, *args[6:])
        assert float(mx.abs(o[:, 0] - out[:, t]).max()) < 1e-5
        j = t + 1
        r_tail, r_state = qm._block_state_after(j)(args[4], args[5], args[0], k, delta, g)
        assert mx.array_equal(r_tail, t_tail)
        assert float(mx.abs(r_state - t_state).max()) < 1e-5
    assert mx.array_equal(tail, t_tail)
    assert float(mx.abs(state - t_state).max()) < 1e-5


def test_cpu_block_uses_pure_mlx():
    def launch(*a, **k):
        raise AssertionError("the CUDA kernel must not run on the CPU")

    args = block_inputs(1, 3)
    got = ck.deltanet_block(args, lambda *a: pure_block(a), *DIMS.values(), EPS, launch=launch)
    for x, y in zip(got, pure_block(args)):
        assert mx.array_equal(x, y)


@pytest.mark.skipif(not emulation_available(), reason="needs a host C++ compiler (g++)")
@pytest.mark.parametrize("L", [1, 2, 6])
def test_block_kernel_source_matches_the_pure_mlx_block(L: int):
    B, threads = 2, 64
    hk, hv, dk, dv = DIMS["hk"], DIMS["hv"], DIMS["dk"], DIMS["dv"]
    C = 2 * hk * dk + hv * dv
    template = [("T", mx.float32), *dict(
        Hk=hk, Hv=hv, Dk=dk, Dv=dv, K=KERNEL, C=C, L=L, NT=threads,
        EPS_E9=round(EPS * 1e9), P=C + hv * dv + 2 * hv, OZ=C, OB=C + hv * dv,
        OA=C + hv * dv + hv).items()]
    args = block_inputs(B, L, seed=L)
    # the kernel reads qkv, z, b, a in place from the joined in-projection row
    joined = mx.concatenate(args[:4], axis=-1)
    names = ("proj", "conv_tail", "state", "conv_weight", "A_log", "dt_bias", "norm_weight")
    inputs = {n: np.array(x, dtype=np.float32) for n, x in zip(names, (joined, *args[4:]))}
    want = [np.array(x) for x in pure_block(args)]
    outputs = {n: (w.shape, np.float32) for n, w in zip(
        ("out", "new_tail", "new_state", "k_out", "delta_out", "g_out"), want)}
    got = emulate_kernel(ck.DELTANET_BLOCK_SOURCE, inputs, outputs, template,
                         blocks=B * hv, threads=threads)
    for (name, value), expected in zip(got.items(), want):
        assert np.abs(value - expected).max() < 2e-5, name


def test_traced_forwards_hand_the_kernels_the_joined_projection(fixture_model, monkeypatch):
    """With the kernels 'available' (stand-in launchers that check their inputs and run the
    pure-MLX cores), traced forwards hand each kernel the in-projection row whose slices
    are qkv, z, b, a, and give the eager results."""
    model = fixture_model(NAME)
    tokens = np.random.default_rng(9).integers(0, VOCAB, (1, 24)).astype(np.int32)
    want, _ = _run(model, tokens, False)
    seen = []

    def stand_in(kind):
        def launch(args, *dims, joined=None):
            # No evaluation here (this runs while the forward is traced): the core reads
            # qkv, z, b, a back from `joined` by the kernel's layout, so a wrong array
            # shows in the outputs.
            seen.append((kind, joined is not None))
            if joined is not None:
                layout = dict(ck._joined(args, None)[1])
                assert joined.shape[-1] == layout["P"]
                cuts = [0, layout["OZ"], layout["OB"], layout["OA"], layout["P"]]
                args = tuple(joined[..., a:b] for a, b in zip(cuts, cuts[1:])) + args[4:]
            core = qm._decode_step if kind == "step" else qm._block_step
            return core(*dims)(*args)
        return launch

    monkeypatch.setattr(ck, "applies", lambda *a: True)
    monkeypatch.setattr(ck, "_verdicts", {})
    monkeypatch.setattr(ck, "_self_check", lambda *a: True)
    monkeypatch.setattr(ck, "_launch", stand_in("step"))
    monkeypatch.setattr(ck, "_launch_block", stand_in("block"))
    monkeypatch.setattr(ck.deltanet_step, "__kwdefaults__", {"launch": stand_in("step"),
                                                             "joined": None})
    monkeypatch.setattr(ck.deltanet_block, "__kwdefaults__", {"launch": stand_in("block"),
                                                              "joined": None})
    model._steps.clear()
    got, _ = _run(model, tokens, True)
    model._steps.clear()
    assert {("step", True), ("block", True)} <= set(seen)
    for x, y in zip(got, want):
        assert float(mx.abs(x - y).max()) < 1e-4


@pytest.mark.parametrize("failure", ["wrong", "raises"])
def test_a_broken_trace_falls_back_to_eager(fixture_model, monkeypatch, failure):
    """A traced forward that computes something else than the eager one (or cannot be
    traced) is dropped at its first call: that call returns the eager result and caches,
    and the model runs eagerly from then on."""
    model = fixture_model(NAME)
    tokens = np.random.default_rng(11).integers(0, VOCAB, (1, 24)).astype(np.int32)
    want, _ = _run(model, tokens, False)
    real = type(model)._step_graph

    def broken(self, *args):
        step = real(self, *args)

        def wrong(*inputs):
            if failure == "raises":
                raise RuntimeError("no trace here")
            out = step(*inputs)
            return [out[0] + 1.0] + out[1:]
        return wrong

    monkeypatch.setattr(type(model), "_step_graph", broken)
    model._steps.clear()
    model.compile_steps = True
    try:
        caches = model.make_cache()
        model(mx.array(tokens[:, :9]), caches)
        got = model(mx.array(tokens[:, 9:10]), caches)
        assert not model.compile_steps and model._steps == {}
        assert float(mx.abs(got - want[1]).max()) < 1e-4
        assert all(c.offset == 10 for c in caches)
        # the caches hold the eager result: the next forward continues it
        assert float(mx.abs(model(mx.array(tokens[:, 10:15]), caches) - want[2]).max()) < 1e-4
    finally:
        model.compile_steps = True
        model._steps.clear()


def test_half_precision_trace_check_tolerates_rounding_but_not_garbage():
    from mlxrunner_qwen3_5.model import _agree

    mx.random.seed(3)
    want = (mx.random.normal((2, 8, 512)) * 4).astype(mx.bfloat16)
    rounding = want + (mx.random.normal(want.shape) * 0.6).astype(mx.bfloat16)  # ~15% noise
    assert _agree(rounding, want)
    assert not _agree(mx.random.normal(want.shape).astype(mx.bfloat16), want)
    exact32 = want.astype(mx.float32)
    assert _agree(exact32 + 1e-4, exact32) and not _agree(exact32 + 0.1, exact32)
