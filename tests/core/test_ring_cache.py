"""mlxrunner.cache.RingCache against a plain account of what it must hold: after any run of
writes, slot ``p % window`` holds position ``p`` for the window's positions, a write returns
the keys its queries attend over (the older window in time order, then its own), and its
mask lets each query see itself, what came before it and nothing older than the window."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from mlxrunner.cache import RingCache


def _positions(start: int, n: int) -> mx.array:
    """Keys whose one entry is their position (values: ten times it)."""
    return mx.arange(start, start + n, dtype=mx.float32).reshape(1, 1, n, 1)


@pytest.mark.parametrize("window", [1, 3, 4, 8])
def test_any_run_of_writes_keeps_each_position_in_its_slot(window):
    rng = random.Random(window)
    for _ in range(40):
        ring, offset = RingCache(window), 0
        for _ in range(6):
            n = rng.choice([1, 1, 2, 3, window, window + 1, 2 * window + 3])
            mask = ring.mask(n)
            keys, values = ring.update_and_fetch(_positions(offset, n),
                                                 10 * _positions(offset, n))
            if n == 1:  # the ring as it stands, the new position in its slot, no mask
                assert mask is None
                assert sorted(np.array(keys).ravel().tolist()) == list(
                    range(max(0, offset + 1 - window), offset + 1))
            else:
                _check_block(keys, values, mask, offset, n, window)
            offset += n
            held = np.array(ring.keys).ravel()
            for p in range(max(0, offset - window), offset):
                assert held[p % window] == p
            assert ring.offset == offset


def _check_block(keys: mx.array, values: mx.array, mask: mx.array | str | None, offset: int,
                 n: int, window: int) -> None:
    """A block's keys: the older window in time order, then its own; its mask: each query
    its own key, the ones before it and none older than the window."""
    seen = list(range(max(0, offset - window), offset + n))
    assert np.array(keys).ravel().tolist() == seen
    assert np.array(values).ravel().tolist() == [10 * p for p in seen]
    queries = np.arange(offset, offset + n)[:, None]
    want = (np.array(seen)[None] <= queries) & (np.array(seen)[None] > queries - window)
    if isinstance(mask, str):
        assert mask == "causal" and (want == np.tri(n, len(seen), len(seen) - n,
                                                    dtype=bool)).all()
    else:
        assert mask is not None and (np.array(mask) == want).all()
