"""Snapshot verify path: restoring after one batched forward equals a plain run.

The speculative round (speculative.md): with the last committed token ``current`` at
slot ``pos``, snapshots are scheduled at ``pos+1 .. pos+N``, one forward runs over
``[current, d_0 .. d_{N-1}]``, and every cache is restored to ``pos + 1 + accepted``.
Afterwards the caches, and the logits of whatever comes next, must equal a plain run over
the committed tokens only (float32, CPU; max abs error < 1e-4 on cached states, and on
logits relative to their largest, 1e-4 * (1 + max |logit|): the two runs split the tokens
into different chunks, so they round differently; seen: 1.4e-4 on logits of about 2).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxrunner.plugin import Cache, KVCache, RecurrentCache
from mlxrunner.testing import check_cache_rollback, run_conformance

mx.set_default_device(mx.cpu)

NAME = "tiny_hk2_hv4_tied"  # 3 DeltaNet layers (Hk 2, Hv 4) + 1 full-attention layer
VOCAB = 256


def assert_caches_equal(got: list, want: list, atol: float = 1e-4) -> None:
    for i, (a, b) in enumerate(zip(got, want)):
        assert type(a) is type(b) and a.offset == b.offset, (i, a.offset, b.offset)
        if isinstance(a, RecurrentCache):
            pairs = [(a.conv_tail, b.conv_tail), (a.recurrent_state, b.recurrent_state)]
        else:
            n = a.offset
            pairs = [(a.keys[..., :n, :], b.keys[..., :n, :]),
                     (a.values[..., :n, :], b.values[..., :n, :])]
        for x, y in pairs:
            assert x.shape == y.shape, (i, x.shape, y.shape)
            err = float(mx.abs(x - y).max())
            assert err < atol, f"layer {i} ({type(a).__name__}): max |error| {err:.3g}"


def assert_logits_close(got: mx.array, want: mx.array) -> None:
    err = float(mx.abs(got - want).max())
    assert err < 1e-4 * (1.0 + float(mx.abs(want).max())), f"logits: max |error| {err:.3g}"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(prompt_len=st.integers(1, 40), draft=st.integers(1, 12), data=st.data(),
       seed=st.integers(0, 2 ** 31 - 1))
def test_restore_equals_plain_run(prompt_len, draft, data, seed, fixture_model):
    model = fixture_model(NAME)
    accepted = data.draw(st.integers(0, draft), label="accepted")
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, VOCAB, (1, prompt_len)).astype(np.int32)
    drafts = rng.integers(0, VOCAB, (1, draft)).astype(np.int32)
    after = rng.integers(0, VOCAB, (1, 2)).astype(np.int32)  # tokens run after the rollback

    # speculative: prefill all but `current`, then one verify forward over N + 1 tokens
    caches = model.make_cache()
    if prompt_len > 1:
        model(mx.array(prompt[:, :-1]), caches)
    pos = prompt_len - 1
    for c in caches:
        c.schedule_snapshots(range(pos + 1, pos + draft + 1))
    block = np.concatenate([prompt[:, -1:], drafts], axis=1)
    verify = model(mx.array(block), caches)
    mx.eval(verify, [c.state for c in caches])
    keep = pos + 1 + accepted
    for c in caches:
        c.restore(keep)
    mx.eval([c.state for c in caches])

    # plain: the committed tokens only
    committed = np.concatenate([prompt, drafts[:, :accepted]], axis=1)
    plain_caches = model.make_cache()
    plain = model(mx.array(committed), plain_caches)
    assert_caches_equal(caches, plain_caches)
    assert_logits_close(verify[:, :accepted + 1], plain[:, pos:])

    # the next tokens see the same state either way (one step, then a two-token forward)
    for step in (after[:, :1], after):
        a, b = model(mx.array(step), caches), model(mx.array(step), plain_caches)
        assert_logits_close(a, b)
    assert_caches_equal(caches, plain_caches)


def test_verify_forward_longer_than_a_chunk(fixture_model):
    """Snapshots inside the second chunk of a 90-token verify forward after a 70-token
    prefill (the chunked kernel's interior boundaries, not only its first chunk)."""
    model = fixture_model(NAME)
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, VOCAB, (1, 160)).astype(np.int32)
    for keep in (71, 134, 135, 159):
        caches = model.make_cache()
        model(mx.array(tokens[:, :70]), caches)
        for c in caches:
            c.schedule_snapshots(range(71, 160))
        model(mx.array(tokens[:, 70:160]), caches)
        for c in caches:
            c.restore(keep)
        plain_caches = model.make_cache()
        model(mx.array(tokens[:, :keep]), plain_caches)
        assert_caches_equal(caches, plain_caches)


def test_core_rollback_conformance(fixture_model):
    """mlxrunner.testing's own rounds (accept none, all, some) and the full conformance run."""
    model = fixture_model("tiny_fullfirst_untied")
    prompt = np.random.default_rng(3).integers(0, VOCAB, (1, 10))
    check_cache_rollback(model, prompt, draft_len=6, accepted=[0, 6, 2, 5])
    assert "cache_rollback" in run_conformance(fixture_model("tiny_alternating_hk1_hv3"),
                                               prompt_len=12, draft_len=5, seed=4)


def test_batched_rollback(fixture_model):
    model = fixture_model(NAME)
    prompt = np.random.default_rng(5).integers(0, VOCAB, (2, 9))
    check_cache_rollback(model, prompt, draft_len=4, accepted=[1, 4, 0])


# -- the cache object itself ----------------------------------------------------------------


def test_recurrent_cache_contract():
    cache = RecurrentCache()
    assert cache.state == [] and cache.offset == 0
    tail, state = mx.zeros((1, 3, 4)), mx.zeros((1, 2, 2, 2))
    cache.schedule_snapshots([3, 5, 9])
    assert cache.snapshot_positions(6) == [3, 5]  # 6 is the end; 9 lies beyond
    captured = []

    def capture(j):
        captured.append(j)
        return tail + j, state + j

    cache.advance(6, tail, state, capture)
    assert cache.offset == 6 and captured == []  # nothing computed until a restore
    with pytest.raises(ValueError, match="cannot restore"):
        cache.restore(4)  # not scheduled
    cache.restore(5)
    assert cache.offset == 5 and captured == [5]
    assert float(cache.recurrent_state.max()) == 5 and cache.scheduled == ()
    cache.restore(5)  # the current offset: nothing to do
    with pytest.raises(ValueError):
        cache.restore(3)  # snapshots were discarded by the restore


def test_recurrent_cache_refuses_a_snapshot_it_did_not_capture():
    cache = RecurrentCache()
    cache.advance(4, mx.zeros((1, 3, 2)), mx.zeros((1, 1, 2, 2)))
    cache.schedule_snapshots([6])
    cache.advance(4, mx.zeros((1, 3, 2)), mx.zeros((1, 1, 2, 2)))  # no capture given
    with pytest.raises(ValueError, match="without capturing"):
        cache.restore(6)


def test_caches_are_exported_kinds(fixture_model):
    caches = fixture_model(NAME).make_cache()
    assert [type(c) for c in caches] == [RecurrentCache] * 3 + [KVCache]
    assert all(isinstance(c, Cache) for c in caches)
