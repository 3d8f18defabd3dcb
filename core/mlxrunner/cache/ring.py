"""Sliding-window key/value ring: the cache of local-attention layers.

Position ``p`` lives in slot ``p % window`` of a ``[B, H, window, D]`` buffer,
so a one-token decode writes one slot and attends over the buffer as it is
(attention does not care about key order), with no mask and no copy. A write
of ``L > 1`` tokens (a prompt, a speculative verify block) must not overwrite
keys that its own earlier queries still need, so it attends over the old window
in time order followed by the new keys, with a sliding-window causal mask, and
then stores the newest ``min(L, window)`` keys.

Snapshots: while the ring has not wrapped past a scheduled offset, rolling back
is an offset move (the slots of later positions are simply ignored). When the
batched write overwrites positions that a scheduled offset still needs, the
write is done out of place and the window as it was before the write is kept
together with the block's new keys; ``restore(o)`` rebuilds the window at ``o``
from those two, i.e. exactly the ring a plain run over the committed tokens
would hold.

A model that writes the buffers inside its own traced step (same layout) asks
``needs_capture(n)`` first and hands the result to ``adopt_write``.

The batched form (:class:`BatchedRingCache`, one ring per row) is here too; the prefix
cache keeps a ring as a snapshot (the whole window at one offset).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import mlx.core as mx

from ..constants import arange_constant, window_mask
from .base import Cache
from .batched import BatchedCache, RowFrame, _row_frame, grow_rows
from .frame import TraceFrame


class RingCache(Cache):
    """Keys and values of the last ``window`` positions, ``[B, H, window, D]``."""

    def __init__(self, window: int) -> None:
        super().__init__()
        if window < 1:
            raise ValueError(f"sliding window must be positive, got {window}")
        self.window = int(window)
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        # (window before the write, its offset, new keys, new values) of the
        # last batched write that overwrote positions a scheduled offset needs
        self._captured: tuple[mx.array, mx.array, int, mx.array, mx.array] | None = None

    # -- reading -----------------------------------------------------------
    def mask(self, n: int) -> mx.array | str | None:
        """Attention mask of ``n`` new queries over what ``update_and_fetch`` of
        ``n`` tokens returns; call it before that update.

        ``None`` (one query: every returned key is visible), ``"causal"`` (no
        key has left any query's window yet) or a boolean ``[n, keys]`` array.
        """
        if n == 1:
            return None
        start = self.offset
        if start + n <= self.window:
            return "causal"
        return window_mask(min(start, self.window), n, self.window)

    # -- writing -----------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Add ``L`` positions; return the keys and values the ``L`` queries attend to
        (use with ``mask(L)`` taken before this call)."""
        n = keys.shape[2]
        start = self.offset
        self._captured = None  # a capture is only good for the write right after it
        if n == 1:
            # A one-token write never needs a capture: its only restorable
            # offset is the one it ends at.
            ring_keys, ring_values = self._held(keys, values)
            slot = start % self.window
            ring_keys[..., slot:slot + 1, :] = keys
            ring_values[..., slot:slot + 1, :] = values
            self.keys, self.values = ring_keys, ring_values
            self.offset = start + 1
            filled = min(self.offset, self.window)
            return ring_keys[..., :filled, :], ring_values[..., :filled, :]

        if start:
            old_keys, old_values = self._in_time_order(start)
            out_keys = mx.concatenate([old_keys, keys], axis=2)
            out_values = mx.concatenate([old_values, values], axis=2)
        else:  # a prompt's first chunk: nothing older to put before it
            out_keys, out_values = keys, values
        capture = self._needs_capture(start, n)
        if n >= self.window and not capture:  # every slot rewritten: the block alone
            self.keys, self.values = self._filled(keys, start), self._filled(values, start)
        else:
            ring_keys, ring_values = self._held(keys, values)
            if capture:
                self._captured = (ring_keys, ring_values, start, keys, values)
            self.keys, self.values = self._written(ring_keys, ring_values, start, keys, values)
        self.offset = start + n
        return out_keys, out_values

    def fresh_length(self, n: int) -> int | None:
        """The positions of the buffers a first write of ``n`` positions makes (the window,
        zero past ``n``), or None where this write is not a first one or stores the block
        as it is (``n >= window``) or keeps a capture: a caller that makes them itself hands
        them to :meth:`adopt_fresh`."""
        # (the exact class: a subclass may keep state this one does not know)
        if type(self) is not RingCache or self.keys is not None or self.values is not None \
                or self.offset or n >= self.window or self._needs_capture(0, n):
            return None
        return self.window

    def adopt_fresh(self, keys: mx.array, values: mx.array, n: int
                    ) -> tuple[mx.array, mx.array]:
        """:meth:`update_and_fetch` of ``n`` positions on an empty ring, given the buffers
        it would make (``fresh_length(n)`` slots, the ``n`` new positions in the first)."""
        self._captured = None
        self.keys, self.values = keys, values
        self.offset = n
        return keys[..., :n, :], values[..., :n, :]

    def _held(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """The ring's buffers, or empty ones for blocks like ``keys``/``values``."""
        if self.keys is None or self.values is None:
            B, H, _, Dk = keys.shape
            return (mx.zeros((B, H, self.window, Dk), keys.dtype),
                    mx.zeros((B, values.shape[1], self.window, values.shape[3]), values.dtype))
        return self.keys, self.values

    def _filled(self, block: mx.array, start: int) -> mx.array:
        """The ring after a write of ``n >= window`` positions at ``start``: the block's last
        ``window`` positions in their slots (``p % window``), as a new array (a slice of
        the block would hold the whole block's buffer as long as the ring)."""
        n, window = block.shape[2], self.window
        first = (start + n) % window  # the slot of the oldest position kept
        if first:  # slots 0 .. first - 1 hold the newest positions
            parts = [block[..., n - first:, :], block[..., n - window:n - first, :]]
        elif n == window:
            return block
        else:  # (in two parts: a new array)
            parts = [block[..., n - window:n - window + 1, :], block[..., n - window + 1:, :]]
        return mx.concatenate(parts, axis=2)

    def _in_time_order(self, start: int) -> tuple[mx.array, mx.array]:
        """The stored window, oldest position first."""
        assert self.keys is not None and self.values is not None
        if start <= self.window:
            return self.keys[..., :start, :], self.values[..., :start, :]
        cut = start % self.window
        if cut == 0:
            return self.keys, self.values
        return (mx.concatenate([self.keys[..., cut:, :], self.keys[..., :cut, :]], axis=2),
                mx.concatenate([self.values[..., cut:, :], self.values[..., :cut, :]], axis=2))

    def _written(self, ring_keys: mx.array, ring_values: mx.array, start: int,
                 keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """The ring after storing ``keys``/``values`` at positions ``start ..``
        (out of place: the given ring is left as it was)."""
        n = keys.shape[2]
        keep = min(n, self.window)
        if keep < n:
            keys, values = keys[..., n - keep:, :], values[..., n - keep:, :]
        first = (start + n - keep) % self.window
        head = min(keep, self.window - first)  # slots before the buffer end
        # Static bounds on new arrays (the given ring's own are left as they were): a
        # dynamic start is a 4-byte index array, which MLX on CUDA serves from its managed
        # scalar pool, read across the bus by each launch
        ring_keys, ring_values = ring_keys[...], ring_values[...]
        ring_keys[..., first:first + head, :] = keys[..., :head, :]
        ring_values[..., first:first + head, :] = values[..., :head, :]
        if head < keep:
            ring_keys[..., :keep - head, :] = keys[..., head:, :]
            ring_values[..., :keep - head, :] = values[..., head:, :]
        return ring_keys, ring_values

    # -- writes done elsewhere (a traced step) -----------------------------
    def needs_capture(self, n: int) -> bool:
        """Whether a write of ``n`` positions now must keep the window it overwrites
        (a scheduled offset inside the write would need it back)."""
        return self._needs_capture(self.offset, n)

    def adopt_write(self, keys: mx.array, values: mx.array, n: int,
                    written: tuple[mx.array, mx.array] | None = None) -> None:
        """Take the buffers a caller computed for ``n`` more positions: slot ``p % window``
        holds position ``p``, exactly as ``update_and_fetch`` would leave them.

        ``written`` (the ``n`` new keys and values) must come with a write for which
        ``needs_capture(n)`` is true; the buffers held until now are kept with it as the
        window before the write.
        """
        if written is not None:
            # a capture keeps the window held until now
            assert self.keys is not None and self.values is not None
            self._captured = (self.keys, self.values, self.offset, *written)
        else:
            self._captured = None
        self.keys, self.values = keys, values
        self.offset += n

    def _needs_capture(self, start: int, n: int) -> bool:
        """Whether writing ``n`` tokens at ``start`` overwrites a position that a
        scheduled offset inside this write still keeps in its window."""
        # Restoring to o (start < o < start + n) needs positions o - window .. o - 1
        # (those >= 0). The write keeps only start + n - window and later, a bound
        # above o - window: a needed position is lost as soon as the bound is > 0.
        inside = any(start < o < start + n for o in self.scheduled)
        return inside and start + n > self.window

    # -- snapshots ---------------------------------------------------------
    def restore(self, offset: int) -> None:
        self._check_restorable(offset)
        captured, self._captured = self._captured, None
        if offset != self.offset and captured is not None:
            ring_keys, ring_values, start, keys, values = captured
            kept = offset - start
            self.keys, self.values = self._written(
                ring_keys, ring_values, start, keys[..., :kept, :], values[..., :kept, :])
        # Without a capture the slots of positions >= offset are never read
        # again before being rewritten: position order is implied by offset.
        self.offset = offset
        self.discard_snapshots()

    def discard_snapshots(self) -> None:
        super().discard_snapshots()
        self._captured = None

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None or self.values is None else [self.keys, self.values]

    # -- traced forwards ------------------------------------------------------------------
    def trace_key(self, length: int) -> Hashable | None:
        if self.keys is None or length > self.window:
            return None
        if length == 1:
            # once every slot holds a position in the window, one query needs no mask
            return (self.keys.shape[0], self.window, 1, self.offset >= self.window - 1)
        return (self.keys.shape[0], self.window, length, self.needs_capture(length))

    def trace_inputs(self, length: int) -> list[mx.array]:
        assert self.keys is not None and self.values is not None  # trace_key saw them
        arrays = [self.keys, self.values]
        if not (length > 1 and self.needs_capture(length)):
            # let go, so that the traced write may reuse the buffers (a ring that
            # captures keeps its window before the write instead)
            self.keys = self.values = None
        return arrays

    def stand_in(self, frame: TraceFrame, arrays: Sequence[mx.array]) -> RingCache:
        return _TracedRingCache(self, frame, arrays, self.offset >= self.window - 1,
                                frame.length > 1 and self.needs_capture(frame.length))

    def adopt(self, outputs: Sequence[mx.array], length: int, record: object) -> None:
        # (a write that captures: trace_inputs kept the window before it, as adopt_write wants)
        written = (outputs[2], outputs[3]) if len(outputs) == 4 else None
        self.adopt_write(outputs[0], outputs[1], length, written)

    def give_back(self, inputs: Sequence[mx.array]) -> None:
        self.keys, self.values = inputs

    # -- batching and the prefix cache ------------------------------------------------------
    def batched(self) -> BatchedRingCache:
        return BatchedRingCache(self.window)

    def prefix_kind(self) -> str | None:
        # the exact class: a subclass may keep state this one does not know
        return "snapshot" if type(self) is RingCache else None

    def prefix_snapshot(self) -> tuple[mx.array, mx.array]:
        assert self.keys is not None and self.values is not None
        return mx.contiguous(self.keys), mx.contiguous(self.values)

    def restore_prefix_snapshot(self, first: mx.array, second: mx.array, length: int) -> None:
        # arrays of their own: a ring writes its buffers in place
        self.keys, self.values = mx.array(first), mx.array(second)
        self.offset = length


class _TracedRingCache(RingCache):
    """A :class:`RingCache` inside a traced forward (see :class:`TraceFrame`). One token is
    written into its slot and attends over the ring as it stands; a block attends over the
    ring before its write followed by itself, then is stored at its slots."""

    keys: mx.array
    values: mx.array

    def __init__(self, source: RingCache, frame: TraceFrame, arrays: Sequence[mx.array],
                 full: bool, capture: bool) -> None:
        super().__init__(source.window)
        self.frame = frame
        self.offset = frame.offset  # type: ignore[assignment]
        self.scheduled = source.scheduled
        self.keys, self.values = arrays
        self.full = full
        self.capture = capture
        self.written: list[mx.array] = []

    def mask(self, n: int) -> mx.array | None:
        if n == 1:
            return self.frame.ring_masks(self.window, self.full)[0]
        return self.frame.block_ring_mask(self.window)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        frame, window = self.frame, self.window
        written_keys = mx.put_along_axis(self.keys, frame.write_slots(keys.shape, window),
                                         keys, axis=2)
        written_values = mx.put_along_axis(self.values,
                                           frame.write_slots(values.shape, window), values,
                                           axis=2)
        if frame.length == 1:
            self.keys, self.values = written_keys, written_values
            mask = self.mask(1)
            frame.hand_out(self.keys, mask, mask)
            return self.keys, self.values
        out_keys = mx.concatenate([self.keys, keys], axis=2)
        out_values = mx.concatenate([self.values, values], axis=2)
        self.keys, self.values = written_keys, written_values
        if self.capture:
            self.written = [keys, values]
        mask = self.mask(frame.length)
        frame.hand_out(out_keys, mask, mask)
        return out_keys, out_values

    def trace_outputs(self) -> list[mx.array]:
        return [self.keys, self.values, *self.written]


class BatchedRingCache(BatchedCache):
    """Sliding window: ``[B, H, window, D]``, position ``p`` of a row at slot
    ``p % window``, as :class:`RingCache` keeps one sequence."""

    def __init__(self, window: int) -> None:
        super().__init__()
        if window < 1:
            raise ValueError(f"sliding window must be positive, got {window}")
        self.window = self.longest_forward = int(window)
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        # (ring keys, ring values before the last block write, the block's keys, values)
        self._before: tuple[mx.array, mx.array, mx.array, mx.array] | None = None

    def _grow_rows(self, rows: int) -> None:
        if self.keys is not None and self.values is not None:
            self.keys, self.values = grow_rows(self.keys, rows), grow_rows(self.values, rows)

    def _copy_row(self, row: int, solo: Cache) -> None:
        if not isinstance(solo, RingCache) or solo.keys is None or solo.values is None \
                or solo.window != self.window:
            raise TypeError(f"a batched ring of window {self.window} takes a filled RingCache "
                            "of the same window")
        if self.keys is None or self.values is None:
            self.keys = mx.zeros((self.rows, *solo.keys.shape[1:]), solo.keys.dtype)
            self.values = mx.zeros((self.rows, *solo.values.shape[1:]), solo.values.dtype)
        self.keys[row:row + 1] = solo.keys
        self.values[row:row + 1] = solo.values

    def _take_rows(self, order: mx.array, length: int) -> None:
        if self.keys is not None and self.values is not None:
            self.keys, self.values = self.keys[order], self.values[order]

    def fill_solo(self, row: int, solo: Cache, length: int,
                  own: Callable[[mx.array], mx.array]) -> bool:
        # a ring cannot be cut back: only the row as it stands
        if type(solo) is not RingCache or length != self.row_offsets[row]:
            return False
        assert self.keys is not None and self.values is not None
        solo.keys = own(self.keys[row:row + 1])
        solo.values = own(self.values[row:row + 1])
        solo.offset = length
        return True

    def bytes_per_row(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return (self.keys.nbytes + self.values.nbytes) // max(self.rows, 1)

    def discard_snapshots(self) -> None:
        super().discard_snapshots()
        self._before = None

    def _restore(self, offsets: list[int], starts: tuple[int, ...]) -> None:
        if self._before is None:
            return  # one-token writes: every kept slot is still in place
        ring_keys, ring_values, keys, values = self._before
        # the block again, its token j written only where the row keeps it (else the slot
        # keeps what it held before the block)
        length = keys.shape[2]
        start = mx.array(list(starts), dtype=mx.int32)[:, None]
        kept = (mx.array(offsets, dtype=mx.int32)[:, None] - start)  # [B, 1]
        j = arange_constant(length)[None]
        slots = mx.remainder(start + j, self.window)[:, None, :, None]  # [B, 1, L, 1]
        keep = (j < kept)[:, None, :, None]
        self.keys = self._rewrite(ring_keys, keys, slots, keep)
        self.values = self._rewrite(ring_values, values, slots, keep)

    @staticmethod
    def _rewrite(ring: mx.array, block: mx.array, slots: mx.array, keep: mx.array) -> mx.array:
        at = mx.broadcast_to(slots, block.shape)
        old = mx.take_along_axis(ring, at, axis=2)
        return mx.put_along_axis(ring, at, mx.where(keep, block, old), axis=2)

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None or self.values is None else [self.keys, self.values]

    # -- forwards --------------------------------------------------------------------------
    def trace_key(self, length: int) -> Hashable | None:
        if self.keys is None or length > self.window:
            return None
        return (self.rows, self.window, length, length > 1 and self.restorable)

    def trace_inputs(self, length: int) -> list[mx.array]:
        assert self.keys is not None and self.values is not None
        arrays = [self.keys, self.values]
        if not (length > 1 and self.restorable):
            self.keys = self.values = None  # the write may reuse the buffers
        return arrays

    def stand_in(self, frame: TraceFrame, arrays: Sequence[mx.array]) -> Cache:
        if frame.length > self.window:
            raise ValueError(f"a batched forward of {frame.length} tokens is longer than the "
                             f"sliding window {self.window}")
        return _RowRingCache(_row_frame(frame), arrays, self.window,
                             frame.length > 1 and self.restorable)

    def adopt(self, outputs: Sequence[mx.array], length: int, record: object) -> None:
        # (a write that captures: trace_inputs kept the window before it)
        self._before = None
        if len(outputs) == 4:
            assert self.keys is not None and self.values is not None
            self._before = (self.keys, self.values, outputs[2], outputs[3])
        self.keys, self.values = outputs[0], outputs[1]
        self._advanced(length)

    def give_back(self, inputs: Sequence[mx.array]) -> None:
        self.keys, self.values = inputs


class _RowRingCache(Cache):
    """A :class:`BatchedRingCache` inside a forward: one token per row goes to its slot and
    attends over the ring as it stands; a block attends over the ring before its write and
    itself, then goes to its slots."""

    def __init__(self, frame: RowFrame, arrays: Sequence[mx.array], window: int,
                 keep_block: bool) -> None:
        super().__init__()
        self.frame = frame
        self.offset = frame.offset  # type: ignore[assignment]
        self.window = window
        self.keys, self.values = arrays
        self.keep_block = keep_block
        self.block: list[mx.array] = []

    def mask(self, n: int) -> mx.array:
        return self.frame.ring_step(self.window) if n == 1 else self.frame.ring_block(self.window)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        # [B, 1, L, 1]
        slots = mx.remainder(self.frame.row_queries(), self.window)[:, None, :, None]
        new_keys = mx.put_along_axis(self.keys, mx.broadcast_to(slots, keys.shape), keys,
                                     axis=2)
        new_values = mx.put_along_axis(self.values, mx.broadcast_to(slots, values.shape),
                                       values, axis=2)
        if self.frame.length == 1:
            out_keys, out_values = new_keys, new_values
        else:
            out_keys = mx.concatenate([self.keys, keys], axis=2)
            out_values = mx.concatenate([self.values, values], axis=2)
            if self.keep_block:
                self.block = [keys, values]
        self.keys, self.values = new_keys, new_values
        mask = self.mask(self.frame.length)
        self.frame.hand_out(out_keys, mask, mask)
        return out_keys, out_values

    def trace_outputs(self) -> list[mx.array]:
        return [self.keys, self.values, *self.block]
