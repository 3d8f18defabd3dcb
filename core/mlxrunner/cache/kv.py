"""Full-attention key/value cache: rollback is an offset move."""

from __future__ import annotations

import mlx.core as mx

from .base import Cache


class KVCache(Cache):
    """Keys and values ``[B, H, S, D]`` in a buffer grown ``step`` tokens at a time."""

    step = 256

    def __init__(self) -> None:
        super().__init__()
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``L`` new positions; return all keys and values up to the new offset."""
        prev = self.offset
        n = keys.shape[2]
        if self.keys is None or prev + n > self.keys.shape[2]:
            B, H, _, Dk = keys.shape
            Dv = values.shape[3]
            grow = ((n + self.step - 1) // self.step) * self.step
            new_k = mx.zeros((B, H, grow, Dk), keys.dtype)
            new_v = mx.zeros((B, values.shape[1], grow, Dv), values.dtype)
            if self.keys is not None:
                self.keys = mx.concatenate([self.keys[..., :prev, :], new_k], axis=2)
                self.values = mx.concatenate([self.values[..., :prev, :], new_v], axis=2)
            else:
                self.keys, self.values = new_k, new_v
        self.offset = prev + n
        self.keys[..., prev:self.offset, :] = keys
        self.values[..., prev:self.offset, :] = values
        return self.keys[..., :self.offset, :], self.values[..., :self.offset, :]

    def restore(self, offset: int) -> None:
        self._check_restorable(offset)
        # Later positions are simply overwritten by the next update.
        self.offset = offset
        self.discard_snapshots()

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]
