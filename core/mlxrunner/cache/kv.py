"""Full-attention key/value cache: rollback is an offset move. Its batched form
(:class:`BatchedKVCache`, rows of keys and values ``[B, H, S, D]``) is here too, and the
prefix cache keeps it per position (:meth:`KVCache.prefix_rows`)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import mlx.core as mx

from .base import Cache
from .batched import BatchedCache, RowFrame, _row_frame, grow_rows
from .frame import TraceFrame, trace_capacity


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

    def fresh_length(self, n: int) -> int | None:
        """The positions of the buffers a first write of ``n`` positions makes (zero past
        ``n``), or None where this write is not a first one: a caller that makes them
        itself hands them to :meth:`adopt_fresh`."""
        # (the exact class: a subclass may keep state this one does not know)
        if type(self) is not KVCache or self.keys is not None or self.values is not None \
                or self.offset:
            return None
        return -(-n // self.step) * self.step

    def adopt_fresh(self, keys: mx.array, values: mx.array, n: int
                    ) -> tuple[mx.array, mx.array]:
        """:meth:`update_and_fetch` of ``n`` positions on an empty cache, given the buffers
        it would make (``fresh_length(n)`` positions, the ``n`` new ones first, zero past)."""
        self.keys, self.values = keys, values
        self.offset = n
        return keys[..., :n, :], values[..., :n, :]

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

    def adopt(self, outputs: Sequence[mx.array], length: int, record: object) -> None:
        self.keys, self.values = outputs
        self.offset += length

    def give_back(self, inputs: Sequence[mx.array]) -> None:
        self.keys, self.values = inputs

    # -- batching and the prefix cache ------------------------------------------------------
    def batched(self) -> BatchedKVCache:
        return BatchedKVCache()

    def prefix_kind(self) -> str | None:
        # the exact class: a subclass may keep state this one does not know
        return "kv" if type(self) is KVCache else None

    def prefix_rows(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        assert self.keys is not None and self.values is not None
        return (mx.contiguous(self.keys[..., start:end, :]),
                mx.contiguous(self.values[..., start:end, :]))

    def fill_prefix(self, keys: mx.array, values: mx.array, length: int) -> None:
        # the first ``length`` positions in buffers of a multiple of ``step`` positions (as
        # update_and_fetch grows them)
        size = -(-length // self.step) * self.step
        keys, values = keys[..., :length, :], values[..., :length, :]
        if size > length:
            pad = size - length
            keys = mx.concatenate(
                [keys, mx.zeros((*keys.shape[:2], pad, keys.shape[3]), keys.dtype)], axis=2)
            values = mx.concatenate(
                [values, mx.zeros((*values.shape[:2], pad, values.shape[3]), values.dtype)],
                axis=2)
        self.keys, self.values = keys, values
        self.offset = length


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
        frame = self.frame
        self.keys = mx.put_along_axis(self.keys, frame.write_slots(keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, frame.write_slots(values.shape), values,
                                        axis=2)
        self.frame.hand_out(self.keys, *self.frame.buffer_masks(self.keys.shape[2]))
        return self.keys, self.values

    def trace_outputs(self) -> list[mx.array]:
        return [self.keys, self.values]


class BatchedKVCache(BatchedCache):
    """Full attention: keys and values ``[B, H, S, D]``, slot ``j`` position ``j`` in each
    row; ``S`` grows through the traced buffer sizes (:func:`trace_capacity`)."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def _room_for(self, length: int) -> int:
        return trace_capacity(length)

    def _ensure_length(self, length: int) -> None:
        assert self.keys is not None and self.values is not None
        if length <= self.capacity:
            return
        size = self._room_for(length)
        B, H, S, Dk = self.keys.shape
        self.keys = mx.concatenate([self.keys, mx.zeros((B, H, size - S, Dk), self.keys.dtype)],
                                   axis=2)
        self.values = mx.concatenate(
            [self.values, mx.zeros((B, self.values.shape[1], size - S, self.values.shape[3]),
                                   self.values.dtype)], axis=2)

    def _grow_rows(self, rows: int) -> None:
        if self.keys is not None and self.values is not None:
            self.keys, self.values = grow_rows(self.keys, rows), grow_rows(self.values, rows)

    def _copy_row(self, row: int, solo: Cache) -> None:
        if not isinstance(solo, KVCache) or solo.keys is None or solo.values is None:
            raise TypeError(f"a batched KV cache takes a filled KVCache, got {type(solo).__name__}")
        n = int(solo.offset)
        if self.keys is None or self.values is None:
            B, (_, H, _, Dk), (_, Hv, _, Dv) = self.rows, solo.keys.shape, solo.values.shape
            size = self._room_for(n + 1)
            self.keys = mx.zeros((B, H, size, Dk), solo.keys.dtype)
            self.values = mx.zeros((B, Hv, size, Dv), solo.values.dtype)
        self._ensure_length(n + 1)
        self.keys[row:row + 1, :, :n, :] = solo.keys[..., :n, :]
        self.values[row:row + 1, :, :n, :] = solo.values[..., :n, :]

    def _take_rows(self, order: mx.array, length: int) -> None:
        if self.keys is None or self.values is None:
            return
        size = min(self.capacity, self._room_for(length))
        self.keys = mx.contiguous(self.keys[order, :, :size])
        self.values = mx.contiguous(self.values[order, :, :size])

    def fill_solo(self, row: int, solo: Cache, length: int,
                  own: Callable[[mx.array], mx.array]) -> bool:
        if type(solo) is not KVCache:
            return False
        assert self.keys is not None and self.values is not None
        solo.keys = own(self.keys[row:row + 1, :, :length])
        solo.values = own(self.values[row:row + 1, :, :length])
        solo.offset = length
        return True

    def bytes_per_token(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        k, v = self.keys, self.values
        return k.shape[1] * k.shape[3] * k.itemsize + v.shape[1] * v.shape[3] * v.itemsize

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None or self.values is None else [self.keys, self.values]

    # -- forwards --------------------------------------------------------------------------
    def trace_key(self, length: int) -> Hashable | None:
        if self.keys is None:
            return None
        need = max(self.row_offsets) + length
        return (self.rows, self.capacity if need <= self.capacity else self._room_for(need))

    def trace_inputs(self, length: int) -> list[mx.array]:
        self._ensure_length(max(self.row_offsets) + length)
        assert self.keys is not None and self.values is not None
        arrays = [self.keys, self.values]
        self.keys = self.values = None  # the write may reuse the buffers
        return arrays

    def stand_in(self, frame: TraceFrame, arrays: Sequence[mx.array]) -> Cache:
        return _RowKVCache(_row_frame(frame), arrays)

    def adopt(self, outputs: Sequence[mx.array], length: int, record: object) -> None:
        self.keys, self.values = outputs
        self._advanced(length)

    def give_back(self, inputs: Sequence[mx.array]) -> None:
        self.keys, self.values = inputs


class _RowKVCache(Cache):
    """A :class:`BatchedKVCache` inside a forward: each row's ``L`` keys go to its own
    positions; attention reads the whole buffer under the rows' causal mask."""

    def __init__(self, frame: RowFrame, arrays: Sequence[mx.array]) -> None:
        super().__init__()
        self.frame = frame
        self.offset = frame.offset  # type: ignore[assignment]
        self.keys, self.values = arrays

    def mask(self, n: int) -> mx.array:
        return self.frame.buffer(self.keys.shape[2])[0]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        at = self.frame.row_queries()[:, None, :, None]  # [B, 1, L, 1]
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(at, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(at, values.shape), values,
                                        axis=2)
        self.frame.hand_out(self.keys, *self.frame.buffer(self.keys.shape[2]))
        return self.keys, self.values

    def trace_outputs(self) -> list[mx.array]:
        return [self.keys, self.values]
