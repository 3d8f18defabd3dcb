"""RingCache (the sliding-window cache) and rollback of whole Gemma 4 models.

Ring: attention through the ring (any write sizes, longer than the window too) equals
attention over every position with a sliding-window causal mask; after a batched write
with scheduled snapshots, ``restore(o)`` leaves exactly the window a plain run over the
first ``o`` positions leaves, also when the write wrapped the ring.

Model: ``mlxrunner.testing.check_cache_rollback`` (verify rounds of random length,
rollback, follow-up decode vs one plain forward over the committed tokens) on the
E2B-like and 31B-like fixtures (window 8), with blocks that wrap the rings.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlxrunner
from mlxrunner.plugin import Model, RingCache
from mlxrunner.testing import check_cache_rollback

mx.set_default_device(mx.cpu)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
B, H, D = 1, 2, 4


def _kv(rng: np.random.Generator, n: int) -> tuple[mx.array, mx.array]:
    return (mx.array(rng.standard_normal((B, H, n, D)).astype(np.float32)),
            mx.array(rng.standard_normal((B, H, n, D)).astype(np.float32)))


def _reference_attention(q: mx.array, keys: mx.array, values: mx.array, start: int,
                         window: int) -> mx.array:
    """Queries at ``start ..`` over all positions ``0 ..`` with a sliding-window causal mask."""
    n = q.shape[2]
    kpos = np.arange(keys.shape[2])[None]
    qpos = np.arange(start, start + n)[:, None]
    mask = mx.array((kpos <= qpos) & (kpos > qpos - window))
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=1.0, mask=mask)


def _window(ring: RingCache) -> tuple[np.ndarray, np.ndarray]:
    """The stored positions max(0, offset - window) .. offset - 1, oldest first."""
    slots = [p % ring.window for p in range(max(0, ring.offset - ring.window), ring.offset)]
    keys, values = np.array(ring.keys), np.array(ring.values)
    return keys[:, :, slots], values[:, :, slots]


@settings(max_examples=60, deadline=None)
@given(window=st.integers(1, 9), chunks=st.lists(st.integers(1, 20), min_size=1, max_size=6),
       seed=st.integers(0, 2**16))
def test_gemma4_ring_attention_equals_sliding_window_attention(window, chunks, seed):
    rng = np.random.default_rng(seed)
    ring = RingCache(window)
    all_k = all_v = None
    for n in chunks:
        k, v = _kv(rng, n)
        q = mx.array(rng.standard_normal((B, H, n, D)).astype(np.float32))
        start = ring.offset
        mask = ring.mask(n)
        keys, values = ring.update_and_fetch(k, v)
        assert ring.offset == start + n
        all_k = k if all_k is None else mx.concatenate([all_k, k], axis=2)
        all_v = v if all_v is None else mx.concatenate([all_v, v], axis=2)
        ours = mx.fast.scaled_dot_product_attention(q, keys, values, scale=1.0, mask=mask)
        expected = _reference_attention(q, all_k, all_v, start, window)
        np.testing.assert_allclose(np.array(ours), np.array(expected), rtol=0, atol=1e-5)
        if n == 1:  # one-token writes attend over the ring itself: no copy, no mask
            assert mask is None and keys.shape[2] == min(ring.offset, window)
    kept_k, _ = _window(ring)
    first = max(0, ring.offset - window)
    np.testing.assert_array_equal(kept_k, np.array(all_k[:, :, first:ring.offset]))


@settings(max_examples=80, deadline=None)
@given(window=st.integers(1, 9), prefix=st.lists(st.integers(1, 12), max_size=3),
       block=st.integers(1, 20), pick=st.integers(0, 10**6), seed=st.integers(0, 2**16))
def test_gemma4_ring_restore_equals_plain_run(window, prefix, block, pick, seed):
    rng = np.random.default_rng(seed)
    ring = RingCache(window)
    ks, vs = [], []
    for n in prefix:
        k, v = _kv(rng, n)
        ring.update_and_fetch(k, v)
        ks.append(k)
        vs.append(v)
    start = ring.offset
    targets = list(range(start + 1, start + block + 1))
    target = targets[pick % len(targets)]
    ring.schedule_snapshots(targets)
    k, v = _kv(rng, block)
    ring.update_and_fetch(k, v)
    ring.restore(target)
    assert ring.offset == target

    plain = RingCache(window)
    kept = target - start
    plain.update_and_fetch(mx.concatenate(ks + [k[:, :, :kept]], axis=2),
                           mx.concatenate(vs + [v[:, :, :kept]], axis=2))
    for mine, theirs in zip(_window(ring), _window(plain)):
        np.testing.assert_array_equal(mine, theirs)
    # and the next writes (one token, then a block) see the same attention
    for n in (1, 5):
        k2, v2 = _kv(rng, n)
        q = mx.array(rng.standard_normal((B, H, n, D)).astype(np.float32))
        outs = []
        for r in (ring, plain):
            mask = r.mask(n)
            keys, values = r.update_and_fetch(k2, v2)
            outs.append(np.array(mx.fast.scaled_dot_product_attention(
                q, keys, values, scale=1.0, mask=mask)))
        np.testing.assert_allclose(outs[0], outs[1], rtol=0, atol=1e-6)


def test_gemma4_ring_wrapped_block_restores_from_the_capture():
    """Window 4, 3 tokens in, a block of 6 wraps the ring: positions 0..2 get overwritten,
    yet restoring to offset 5 must bring back positions 1 and 2."""
    rng = np.random.default_rng(0)
    ring = RingCache(4)
    k0, v0 = _kv(rng, 3)
    ring.update_and_fetch(k0, v0)
    ring.schedule_snapshots(range(4, 10))
    k1, v1 = _kv(rng, 6)
    ring.update_and_fetch(k1, v1)
    ring.restore(5)
    keys, _ = _window(ring)  # positions 1, 2, 3, 4
    expected = np.concatenate([np.array(k0[:, :, 1:]), np.array(k1[:, :, :2])], axis=2)
    np.testing.assert_array_equal(keys, expected)


def test_gemma4_ring_unwrapped_rollback_is_an_offset_move():
    rng = np.random.default_rng(1)
    ring = RingCache(16)
    ring.update_and_fetch(*_kv(rng, 3))
    ring.schedule_snapshots(range(4, 9))
    ring.update_and_fetch(*_kv(rng, 5))
    assert ring._captured is None  # nothing a target needs was overwritten
    ring.restore(5)
    assert ring.offset == 5 and ring.scheduled == ()


def test_gemma4_ring_refuses_unscheduled_offsets():
    ring = RingCache(4)
    ring.update_and_fetch(*_kv(np.random.default_rng(2), 6))
    with pytest.raises(ValueError, match="cannot restore"):
        ring.restore(3)
    with pytest.raises(ValueError):
        RingCache(0)


# -- whole models ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def models() -> dict[str, Model]:
    return {name: mlxrunner.load_model(FIXTURES / name) for name in ("e2b", "dense")}


@pytest.mark.parametrize("name", ["e2b", "dense"])
@pytest.mark.parametrize("prompt_len, draft_len, accepted", [
    (7, 6, [0, 6, 3]),    # offset 6 + block 7 > window 8: the rings wrap mid-block
    (20, 12, [5, 0, 12]),  # block of 13 longer than the window
    (2, 3, [1, 3]),       # the ring never wraps: rollback is an offset move
])
def test_gemma4_rollback_examples(models, name, prompt_len, draft_len, accepted):
    prompt = np.random.default_rng(prompt_len).integers(3, 128, (1, prompt_len))
    check_cache_rollback(models[name], prompt, draft_len, accepted, follow_up=3)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(["e2b", "dense"]), prompt_len=st.integers(1, 20),
       draft_len=st.integers(1, 12), data=st.data(), seed=st.integers(0, 2**16))
def test_gemma4_rollback_property(models, name, prompt_len, draft_len, data, seed):
    accepted = data.draw(st.lists(st.integers(0, draft_len), min_size=1, max_size=3))
    prompt = np.random.default_rng(seed).integers(0, 128, (1, prompt_len))
    check_cache_rollback(models[name], prompt, draft_len, accepted, seed=seed, follow_up=2)
