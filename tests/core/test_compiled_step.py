"""The core's compiled decode step (``mlxrunner.decode.step``) for any architecture.

- A model written in plain ``mlx.nn`` (``mx.fast.scaled_dot_product_attention`` over the
  keys its ``KVCache``/``RingCache`` hands out, masks "causal"/None or the ring's own) gets
  traced decode steps and verify blocks that equal its eager forward, rollback included,
  and so does a Gated DeltaNet target (Qwen3.5's tiny fixture, taps and batch 2).
- A trace is reused across steps and generations; new weights drop it.
- A mask the model builds over cached keys is restricted to the buffer's written slots.
- A trace that computes something else, or cannot be traced, is dropped at its first call
  with one warning: that call returns the eager result, and the model runs eagerly on.
- The check that compares traced and eager logits tolerates half-precision rounding but
  not garbage.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

import mlxrunner
from mlxrunner import SamplerOptions, generate, settings
from mlxrunner.decode import agree, compiled_steps, forward
from mlxrunner.testing import check_compiled_step, random_prompt
from plain_mlx_model import PlainAttention, PlainModel

mx.set_default_device(mx.cpu)

QWEN = Path(__file__).resolve().parents[2] / "architectures" / "qwen3_5" / "tests" / \
    "fixtures" / "tiny_hk2_hv4_tied"


def plain_model(window=None, seed=0):
    mx.random.seed(seed)
    model = PlainModel(window)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("window", [None, 3, 6])
@pytest.mark.parametrize("batch", [1, 2])
def test_plain_mlx_model_gets_the_compiled_step(window, batch):
    model = plain_model(window)
    prompt = random_prompt(model.vocab_size, batch, 9, seed=batch)
    block = min(4, window) if window else 4
    assert check_compiled_step(model, prompt, steps=4, block=block, rounds=4) > 0


def test_qwen3_5_gets_the_compiled_step():
    if not (QWEN / "config.json").exists():
        pytest.skip(f"no tiny Qwen3.5 checkpoint at {QWEN}")
    model = mlxrunner.load_model(QWEN, dtype="float32")
    for batch in (1, 2):
        prompt = random_prompt(model.vocab_size, batch, 9, seed=batch)
        assert check_compiled_step(model, prompt, taps=[2, 0], seed=batch) > 0


def test_traces_are_reused_and_dropped_with_new_weights():
    model = plain_model()
    options = SamplerOptions(temperature=0)
    prompt = [1, 2, 3, 4, 5]
    first = generate(model, prompt, max_tokens=12, options=options).tokens
    steps = compiled_steps(model)
    assert len(steps._traced) == 1 and steps.replays() == 10
    assert generate(model, prompt, max_tokens=12, options=options).tokens == first
    assert len(steps._traced) == 1 and steps.replays() == 21  # the same trace again
    model.update({"norm": {"weight": model.norm.weight * 0 + 2.0}})
    assert compiled_steps(model) is not steps  # update() dropped the old traces
    changed = generate(model, prompt, max_tokens=12, options=options).tokens
    with settings.overridden(compile=False):
        assert generate(model, prompt, max_tokens=12, options=options).tokens == changed


def test_a_trace_is_made_per_kernel_setting():
    """A trace bakes in the kernels and how they launch: packed images or cubins
    (``packed_kernels``) and the kernels allowed each get a trace of their own."""
    model = plain_model()
    options = SamplerOptions(temperature=0)
    want = generate(model, [1, 2, 3], max_tokens=4, options=options).tokens
    steps = compiled_steps(model)
    assert steps.shapes == 1
    for changes in ({"packed_kernels": False}, {"kernels": frozenset()}):
        with settings.overridden(**changes):
            assert generate(model, [1, 2, 3], max_tokens=4, options=options).tokens == want
    assert steps.shapes == 3


@pytest.mark.parametrize("failure", ["wrong", "raises"])
def test_a_broken_trace_falls_back_to_eager(failure, monkeypatch, caplog):
    model = plain_model()
    ids = random_prompt(model.vocab_size, 1, 14, seed=3)
    with settings.overridden(compile=False):
        caches = model.make_cache()
        model(ids[:, :9], caches)
        want = [model(ids[:, 9:10], caches), model(ids[:, 10:14], caches)]
    steps = compiled_steps(model)
    real = type(steps)._graph

    def broken(self, *args):
        graph = real(self, *args)

        def wrong(*inputs):
            if failure == "raises":
                raise RuntimeError("no trace here")
            out = graph(*inputs)
            return [out[0] + 1.0] + out[1:]
        return wrong

    monkeypatch.setattr(type(steps), "_graph", broken)
    caches = model.make_cache()
    model(ids[:, :9], caches)
    got = forward(model, ids[:, 9:10], caches)
    assert not steps.enabled and steps.replays() == 0
    assert "running eagerly" in caplog.text
    assert float(mx.abs(got - want[0]).max()) < 1e-5
    assert all(c.offset == 10 for c in caches)
    # the caches hold the eager result: the next forward continues it
    assert float(mx.abs(forward(model, ids[:, 10:14], caches) - want[1]).max()) < 1e-5


def test_the_trace_check_tolerates_half_precision_rounding_but_not_garbage():
    mx.random.seed(3)
    want = (mx.random.normal((2, 8, 512)) * 4).astype(mx.bfloat16)
    rounding = want + (mx.random.normal(want.shape) * 0.6).astype(mx.bfloat16)  # ~15% noise
    assert agree(rounding, want)
    assert not agree(mx.random.normal(want.shape).astype(mx.bfloat16), want)
    exact32 = want.astype(mx.float32)
    assert agree(exact32 + 1e-4, exact32) and not agree(exact32 + 0.1, exact32)


def test_a_mask_the_model_built_over_cached_keys_is_traced_exactly(monkeypatch):
    """A boolean mask the model builds over the keys a cache handed out (made for the
    exact-length keys of an eager forward) is restricted to the written slots of the
    traced buffer: the trace is exact and stays on."""

    def own_mask_attention(self, x, cache):
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.kv_heads, -1).transpose(0, 2, 1, 3)
        k, v = cache.update_and_fetch(k, v)
        mask = mx.ones((L, k.shape[2]), dtype=mx.bool_)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    monkeypatch.setattr(PlainAttention, "__call__", own_mask_attention)
    model = plain_model()
    ids = random_prompt(model.vocab_size, 1, 8, seed=1)
    caches, eager_caches = model.make_cache(), model.make_cache()
    model(ids[:, :7], caches)
    model(ids[:, :7], eager_caches)
    got = forward(model, ids[:, 7:8], caches)
    want = model(ids[:, 7:8], eager_caches)
    assert float(mx.abs(got - want).max()) < 1e-5
    assert compiled_steps(model).enabled and len(compiled_steps(model)._traced) == 1
