"""Full-attention key/value cache: rollback is an offset move."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import mlx.core as mx

from .base import Cache
from .frame import TraceFrame


def trace_capacity_step() -> int:
    """Traced forwards attend over a whole buffer, masked, and are traced once per buffer
    size: buffers grow in steps of this many positions. A CPU pays for the masked
    positions more than for the rarer retraces, a GPU the other way round."""
    return 256 if mx.default_device() == mx.cpu else 1024


def bucket_capacity(length: int, step: int) -> int:
    """A buffer size for ``length`` positions: 1, 2, 3 or 4 steps of ``step``, then the next
    of 6, 8, 12, 16, 24, ... steps (a power of two or one and a half times one). A context of ``n``
    steps thus passes through about ``2 log2(n)`` sizes, not ``n`` (each a trace of its own
    and, on CUDA, graphs of its own), leaving at most a third of a buffer unused."""
    steps = -(-max(length, 1) // step)
    if steps > 4:
        power = 1 << (steps.bit_length() - 1)
        steps = power if steps == power else power * 3 // 2 if steps <= power * 3 // 2 \
            else power * 2
    return steps * step


def trace_capacity(length: int) -> int:
    """The buffer size a traced forward uses for ``length`` positions (see
    :func:`bucket_capacity` and :func:`trace_capacity_step`)."""
    return bucket_capacity(length, trace_capacity_step())


class KVCache(Cache):
    """Keys and values ``[B, H, S, D]`` in a buffer grown ``step`` tokens at a time."""

    step = 256

    def __init__(self) -> None:
        super().__init__()
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

    def mask(self, n: int) -> mx.array | str | None:
        """The attention mask of ``n`` new queries over what ``update_and_fetch`` of ``n``
        tokens returns: None for one query, else "causal" (aligned to the last key)."""
        return None if n == 1 else "causal"

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``L`` new positions; return all keys and values up to the new offset."""
        prev = self.offset
        n = keys.shape[2]
        if self.keys is None or self.values is None or prev + n > self.keys.shape[2]:
            B, H, _, Dk = keys.shape
            Dv = values.shape[3]
            grow = ((n + self.step - 1) // self.step) * self.step
            new_k = mx.zeros((B, H, grow, Dk), keys.dtype)
            new_v = mx.zeros((B, values.shape[1], grow, Dv), values.dtype)
            if self.keys is not None and self.values is not None:
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
        return [] if self.keys is None or self.values is None else [self.keys, self.values]

    # -- traced forwards ------------------------------------------------------------------
    def trace_key(self, length: int) -> Hashable | None:
        if self.keys is None:
            return None
        return (self.keys.shape[0], self._traced_size(length))

    def _traced_size(self, length: int) -> int:
        assert self.keys is not None  # trace_key saw it
        size = self.keys.shape[2]
        if size >= self.offset + length and size == trace_capacity(size):
            return size
        return trace_capacity(self.offset + length)

    def trace_inputs(self, length: int) -> list[mx.array]:
        size = self._traced_size(length)
        assert self.keys is not None and self.values is not None
        if size != self.keys.shape[2]:
            self._resize(size)
        arrays = [self.keys, self.values]
        # let go, so that the traced write may reuse the buffers
        self.keys = self.values = None
        return arrays

    def _resize(self, size: int) -> None:
        assert self.keys is not None and self.values is not None
        B, H, _, Dk = self.keys.shape
        keys = mx.zeros((B, H, size, Dk), self.keys.dtype)
        values = mx.zeros((B, self.values.shape[1], size, self.values.shape[3]),
                          self.values.dtype)
        n = min(self.offset, self.keys.shape[2])
        keys[..., :n, :] = self.keys[..., :n, :]
        values[..., :n, :] = self.values[..., :n, :]
        self.keys, self.values = keys, values

    def stand_in(self, frame: TraceFrame, arrays: Sequence[mx.array]) -> KVCache:
        return _TracedKVCache(self, frame, arrays)

    def adopt(self, inputs: Sequence[mx.array], outputs: Sequence[mx.array], length: int,
              record: object) -> None:
        self.keys, self.values = outputs
        self.offset += length

    def give_back(self, inputs: Sequence[mx.array]) -> None:
        self.keys, self.values = inputs


class _TracedKVCache(KVCache):
    """A :class:`KVCache` inside a traced forward: writes go into the fixed-size buffers at
    the traced offset, reads return the whole buffers (see :class:`TraceFrame`)."""

    keys: mx.array
    values: mx.array

    def __init__(self, source: KVCache, frame: TraceFrame, arrays: Sequence[mx.array]) -> None:
        super().__init__()
        self.frame = frame
        self.offset = frame.offset  # type: ignore[assignment]
        self.scheduled = source.scheduled
        self.keys, self.values = arrays

    def mask(self, n: int) -> mx.array:
        causal, _ = self.frame.buffer_masks(self.keys.shape[2])
        return causal

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = mx.slice_update(self.keys, keys, self.frame.start, (2,))
        self.values = mx.slice_update(self.values, values, self.frame.start, (2,))
        self.frame.hand_out(self.keys, *self.frame.buffer_masks(self.keys.shape[2]))
        return self.keys, self.values

    def trace_outputs(self) -> list[mx.array]:
        return [self.keys, self.values]
