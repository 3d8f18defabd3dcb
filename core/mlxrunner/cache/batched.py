"""Caches that hold several sequences of different lengths, one row each (continuous
batching): what every kind's batched cache shares, and the caches of a model's layers.

Each cache kind keeps its batched form in its own module, beside its solo cache (which
returns it from :meth:`Cache.batched`): full keys/values (:class:`~.kv.BatchedKVCache`),
sliding rings (:class:`~.ring.BatchedRingCache`) and recurrent state
(:class:`~.recurrent.BatchedRecurrentCache`). This module holds their base
(:class:`BatchedCache`), the frame of a batched forward (:class:`RowFrame`) and
:class:`BatchCaches`.

Every row has its own offset: ``offset`` is an int32 array ``[B]`` (what RoPE takes) and
``row_offsets`` the same as Python ints. A forward of ``L`` tokens per row writes each row
at its own positions and hands attention the whole buffer with a boolean mask
``[B, 1, L, S]`` that says, per row, which slots its queries see.

These caches always run inside a frame (:class:`TraceFrame` with a ``[B]`` offset): the
core's step (:func:`mlxrunner.decode.step.forward`) runs the model on their stand-ins, traced
or not, and finds the mask for keys they handed out, so an architecture written in plain
``mlx.nn`` (``mx.fast.scaled_dot_product_attention`` with "causal" or None) attends
exactly, as an architecture calling :func:`mlxrunner.nn.store` does.

Rows join (:meth:`BatchCaches.add` copies one sequence's solo caches, after its prefill,
into a free row) and leave (:meth:`BatchCaches.remove` frees the row; nothing is copied).
Free rows keep offset 0 and never advance; what a forward writes there is never read.
:meth:`BatchedCache.fill_solo` copies a row back into a solo cache (for the prefix cache).

Rollback per row: after a forward of ``L`` tokens per row, ``restore_rows(offsets)`` puts
each row back to any offset in ``[start, start + L]`` of that forward (the speculative verify
of a batch: every row keeps its accepted prefix). Full KV moves the offset; a ring rebuilds
the row from the window before the write and the accepted part of the block; a recurrent
layer takes, per row, the state after its accepted tokens from the forward's capture.
Rollback must be asked for (:meth:`BatchedCache.keep_for_restore`) before the forward, which
then keeps what it needs.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import mlx.core as mx

from ..constants import arange_constant
from .base import Cache
from .frame import TraceFrame, trace_capacity


class RowFrame(TraceFrame):
    """One forward of ``length`` tokens per row over batched caches, the rows starting at
    ``offset`` ``[B]`` (traced or not): the masks its layers share."""

    def __init__(self, offset: mx.array, length: int) -> None:
        if offset.ndim != 1:
            raise ValueError(f"a batched forward takes one offset per row, got {offset.shape}")
        super().__init__(offset.reshape(1, -1)[0, :1], length)  # (start: unused by rows)
        self.offset = offset
        self.made: dict[Hashable, Any] = {}

    def row_queries(self) -> mx.array:
        """Positions of each row's new tokens ``[B, L]``."""
        if "queries" not in self.made:
            self.made["queries"] = self.offset[:, None] + arange_constant(self.length)[None]
        return self.made["queries"]

    def buffer(self, size: int) -> tuple[mx.array, mx.array]:
        """Slot ``j`` holds position ``j``: (causal ``[B, 1, L, size]``, written
        ``[B, 1, 1, size]``)."""
        key = ("buffer", size)
        if key not in self.made:
            slots = arange_constant(size)[None, None]
            causal = slots <= self.row_queries()[:, :, None]
            written = slots <= self.row_queries()[:, -1:, None]
            self.made[key] = (causal[:, None], written[:, None])
        return self.made[key]

    def ring_step(self, window: int) -> mx.array:
        """One token written at slot ``offset % window``, then attention over the ring:
        the slots that hold a position ``[B, 1, 1, window]``."""
        key = ("ring1", window)
        if key not in self.made:
            self.made[key] = (arange_constant(window)[None] <= self.offset[:, None]
                              )[:, None, None]
        return self.made[key]

    def ring_block(self, window: int) -> mx.array:
        """A block of ``L <= window`` tokens attends over the ring before its write (slot
        ``s`` holds position ``(offset - 1) - ((offset - 1 - s) mod window)``, negative where
        never written) followed by itself: ``[B, 1, L, window + L]``."""
        key = ("ring", window)
        if key not in self.made:
            last = self.offset[:, None] - 1
            held = last - mx.remainder(last - arange_constant(window)[None], window)
            pos = mx.concatenate([held, self.row_queries()], axis=1)[:, None]  # [B, 1, W + L]
            q = self.row_queries()[:, :, None]  # [B, L, 1]
            self.made[key] = ((pos >= 0) & (pos <= q) & (pos > q - window))[:, None]
        return self.made[key]


def _row_frame(frame: TraceFrame) -> RowFrame:
    if not isinstance(frame, RowFrame):
        raise TypeError("a batched cache runs in a RowFrame (mlxrunner.decode.step.forward)")
    return frame


def grow_rows(array: mx.array, rows: int) -> mx.array:
    """``array`` with zero rows appended up to ``rows`` (axis 0)."""
    extra = rows - array.shape[0]
    if extra <= 0:
        return array
    return mx.concatenate([array, mx.zeros((extra, *array.shape[1:]), array.dtype)])


def _row_select(rows: Sequence[int], n: int) -> mx.array:
    """A boolean ``[n]`` array, True at ``rows``."""
    chosen = set(rows)
    return mx.array([i in chosen for i in range(n)], dtype=mx.bool_)


class BatchedCache(Cache):
    """Base of the batched caches: per-row offsets and the rows in use.

    Only :class:`BatchCaches` changes the rows; a forward runs on a stand-in (see the
    module) and the cache adopts what it wrote.
    """

    #: the most tokens one forward may write per row (None: any number)
    longest_forward: int | None = None

    def __init__(self) -> None:
        super().__init__()
        self.row_offsets: tuple[int, ...] = ()
        self.live: tuple[bool, ...] = ()
        self.offset = mx.zeros((0,), dtype=mx.int32)  # type: ignore[assignment]
        self.restorable = False
        self._forward_starts: tuple[int, ...] | None = None

    @property
    def rows(self) -> int:
        return len(self.row_offsets)

    def _set_offsets(self, offsets: Sequence[int]) -> None:
        self.row_offsets = tuple(int(o) for o in offsets)
        self.offset = mx.array(self.row_offsets, dtype=mx.int32)  # type: ignore[assignment]

    # -- rows (called by BatchCaches) ----------------------------------------------------
    def set_rows(self, rows: int) -> None:
        """Room for ``rows`` rows (more: free rows appended; never fewer, see compact)."""
        if rows > self.rows:
            self.live = self.live + (False,) * (rows - self.rows)
            self._set_offsets(self.row_offsets + (0,) * (rows - self.rows))
            self._grow_rows(rows)

    def insert(self, row: int, solo: Cache) -> None:
        """Copy a one-sequence cache (batch 1, after its prefill) into the free ``row``."""
        if self.live[row]:
            raise ValueError(f"row {row} is in use")
        self.discard_snapshots()
        self._copy_row(row, solo)
        self.live = self.live[:row] + (True,) + self.live[row + 1:]
        offsets = list(self.row_offsets)
        offsets[row] = int(solo.offset)
        self._set_offsets(offsets)

    def remove(self, row: int) -> None:
        """Free ``row`` (its contents stay where they are, unread, until a sequence joins)."""
        self.discard_snapshots()
        self.live = self.live[:row] + (False,) + self.live[row + 1:]
        offsets = list(self.row_offsets)
        offsets[row] = 0
        self._set_offsets(offsets)

    def compact(self, order: Sequence[int], length: int) -> None:
        """Keep rows ``order`` (in that order) and room for ``length`` positions."""
        self.discard_snapshots()
        self._take_rows(mx.array(list(order), dtype=mx.int32), length)
        self.live = tuple(self.live[r] for r in order)
        self._set_offsets([self.row_offsets[r] for r in order])

    def _grow_rows(self, rows: int) -> None:
        raise NotImplementedError

    def _copy_row(self, row: int, solo: Cache) -> None:
        raise NotImplementedError

    def _take_rows(self, order: mx.array, length: int) -> None:
        raise NotImplementedError

    def fill_solo(self, row: int, solo: Cache, length: int,
                  own: Callable[[mx.array], mx.array]) -> bool:
        """Make ``solo`` (a new cache of the kind this one batches, from the model's
        ``make_cache``) hold the first ``length`` positions of ``row``, each array passed
        through ``own`` (a copy, or not); False where this kind cannot give that row at that
        length (``solo`` is then not to be used)."""
        return False

    # -- rollback ------------------------------------------------------------------------
    def keep_for_restore(self) -> None:
        """The next forward keeps what :meth:`restore_rows` needs."""
        self.restorable = True

    def restore_rows(self, offsets: Sequence[int]) -> None:
        """Each live row back to ``offsets[row]``, within ``[start, start + L]`` of the last
        forward of ``L`` tokens (which :meth:`keep_for_restore` preceded)."""
        if len(offsets) != self.rows:
            raise ValueError(f"restore_rows: {len(offsets)} offsets for {self.rows} rows")
        offsets = [int(o) if self.live[r] else 0 for r, o in enumerate(offsets)]
        if offsets != list(self.row_offsets):
            starts = self._forward_starts
            if starts is None:
                raise ValueError("restore_rows: the last forward kept nothing to restore")
            for r, (o, s, e) in enumerate(zip(offsets, starts, self.row_offsets)):
                if self.live[r] and not s <= o <= e:
                    raise ValueError(f"cannot restore row {r} to offset {o}: the last forward "
                                     f"covered [{s}, {e}]")
            self._restore(offsets, starts)
        self._set_offsets(offsets)
        self.discard_snapshots()

    def _restore(self, offsets: list[int], starts: tuple[int, ...]) -> None:
        """Rebuild the rows whose offset moves back (the offsets are set afterwards)."""

    def restore(self, offset: int) -> None:
        raise TypeError("a batched cache restores per row: restore_rows(offsets)")

    def discard_snapshots(self) -> None:
        super().discard_snapshots()
        self.restorable = False
        self._forward_starts = None

    def _advanced(self, length: int) -> None:
        """After a forward of ``length`` tokens: live rows move on, free rows stay at 0."""
        self._forward_starts = self.row_offsets if self.restorable else None
        self.restorable = False
        self._set_offsets([o + length if live else 0
                           for o, live in zip(self.row_offsets, self.live)])

    # -- a batched cache is only ever used through its stand-in ---------------------------
    def mask(self, n: int) -> mx.array | str | None:
        raise TypeError("batched caches run through mlxrunner.decode.step.forward")

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        raise TypeError("batched caches run through mlxrunner.decode.step.forward")

    def bytes_per_token(self) -> int:
        """Bytes a row's buffer takes per cached position (0: a fixed size per row)."""
        return 0

    @property
    def capacity(self) -> int:
        """Positions a row's buffer holds now (0: a fixed size per row)."""
        return 0

    def bytes_per_row(self) -> int:
        """Bytes a row takes whatever its length."""
        return 0


class BatchCaches:
    """A model's layers' batched caches and the rows they hold.

    ``caches`` is what the model's forward takes (``None`` where ``make_cache`` gave None).
    Rows are reused once freed; the row count grows by doubling (each count is its own
    traced step) and :meth:`compact` shrinks it.
    """

    def __init__(self, template: Sequence[Cache | None]) -> None:
        self.caches: list[BatchedCache | None] = [None if c is None else c.batched()
                                                  for c in template]
        self.layers = [c for c in self.caches if c is not None]
        if not self.layers:
            raise ValueError("a batch needs at least one layer with a cache")
        self.live: list[bool] = []

    @property
    def rows(self) -> int:
        return len(self.live)

    @property
    def row_offsets(self) -> tuple[int, ...]:
        return self.layers[0].row_offsets

    def live_rows(self) -> list[int]:
        return [r for r, live in enumerate(self.live) if live]

    @property
    def longest_forward(self) -> int | None:
        """The most tokens one forward may write per row (a sliding window's; None: any)."""
        limits = [c.longest_forward for c in self.layers if c.longest_forward is not None]
        return min(limits) if limits else None

    def add(self, solo: Sequence[Cache | None]) -> int:
        """Copy one sequence's caches (batch 1, after its prefill) into a free row, made if
        none is free; returns the row."""
        if len(solo) != len(self.caches):
            raise ValueError(f"{len(solo)} caches for a batch of {len(self.caches)} layers")
        free = [r for r, live in enumerate(self.live) if not live]
        if free:
            row = free[0]
        else:
            row = self.rows
            self._set_rows(max(1, 2 * self.rows))
        for batched, one in zip(self.caches, solo):
            if batched is None:
                continue
            if one is None:
                raise ValueError("the sequence's caches differ from the batch's layers")
            batched.insert(row, one)
        self.live[row] = True
        return row

    def remove(self, row: int) -> None:
        """Free ``row``; the others stay where they are."""
        for c in self.layers:
            c.remove(row)
        self.live[row] = False

    def compact(self) -> dict[int, int]:
        """Move the live rows to the front of as few rows as hold them (a power of two) and
        drop unneeded room; returns old row -> new row. Copies every live row: call rarely."""
        keep = self.live_rows()
        rows = 1
        while rows < len(keep):
            rows *= 2
        free = [r for r in range(self.rows) if r not in keep][:rows - len(keep)]
        order = keep + free
        longest = max([self.row_offsets[r] for r in keep], default=0) + 1
        for c in self.layers:
            c.compact(order, longest)
        self.live = [True] * len(keep) + [False] * len(free)
        return {old: new for new, old in enumerate(keep)}

    def _set_rows(self, rows: int) -> None:
        for c in self.layers:
            c.set_rows(rows)
        self.live += [False] * (rows - self.rows)

    #: a round's verify forward is padded to a few widths (see the scheduler's verify_width)
    pads_verify = True

    def row_caches(self, row: int, make: Callable[[], Sequence[Cache | None]],
                   copy: bool = True, length: int | None = None) -> list[Cache | None] | None:
        """``row`` as a solo sequence's caches (new ones from ``make``, the model's
        ``make_cache``, filled here), in arrays of their own, or views of the batch's
        (``copy`` False: read now, not kept); ``length``: its first positions only (None
        where a kind cannot be cut back, or the prefix cache does not keep it)."""
        own: Callable[[mx.array], mx.array] = mx.array if copy else (lambda a: a)
        solo = make()
        n = self.row_offsets[row] if length is None else length
        for mine, batched in zip(solo, self.caches):
            if mine is not None and batched is not None and \
                    not batched.fill_solo(row, mine, n, own):
                return None
        return list(solo)

    # -- rollback --------------------------------------------------------------------------
    def keep_for_restore(self, length: int) -> None:
        """A forward of ``length`` tokens per row follows: keep what any row's rollback into
        it needs."""
        for c in self.layers:
            c.keep_for_restore()

    def restore_rows(self, offsets: Sequence[int]) -> None:
        for c in self.layers:
            c.restore_rows(offsets)

    # -- memory --------------------------------------------------------------------------
    def bytes_per_token(self) -> int:
        return sum(c.bytes_per_token() for c in self.layers)

    def bytes_per_row(self) -> int:
        return sum(c.bytes_per_row() for c in self.layers)

    def bytes_for(self, rows: int, positions: int) -> int:
        """Bytes the caches take at ``rows`` rows (rounded up to what the batch allocates)
        holding ``positions`` positions each (at least as many as they hold now): rows as
        long as the longest, as the buffers are."""
        allocated = max(self.rows, 1 << max(0, rows - 1).bit_length())
        return sum(c.bytes_per_row() + c.bytes_per_token() * max(
            c.capacity, trace_capacity(positions) if c.bytes_per_token() else 0)
            for c in self.layers) * allocated

    @property
    def state(self) -> list[mx.array]:
        return [a for c in self.layers for a in c.state]


class SoloCaches:
    """One sequence's own caches in the place of :class:`BatchCaches`, for a scheduler of one
    row (:func:`mlxrunner.generate` with a draft): its forwards are a solo sequence's (a
    scalar offset, the solo trace) and its rollback the caches' own snapshots, so every
    cache kind serves, one without a batched form included. A round's rollback is applied
    when the caches are next read, so that a sequence ending inside the round may still be
    cut back to the tokens it kept."""

    pads_verify = False
    rows = 1
    longest_forward: int | None = None

    def __init__(self) -> None:
        self._solo: list[Cache | None] = []
        self._live: list[Cache] = []
        self._restore_to: int | None = None

    @property
    def caches(self) -> list[Cache | None]:
        self._settle()
        return self._solo

    def _settle(self) -> None:
        if self._restore_to is not None:
            for c in self._live:
                c.restore(self._restore_to)
            self._restore_to = None

    @property
    def row_offsets(self) -> tuple[int, ...]:
        if self._restore_to is not None:
            return (self._restore_to,)
        return (self._live[0].offset if self._live else 0,)

    def add(self, solo: Sequence[Cache | None]) -> int:
        """Take one sequence's caches (after its prefill) as row 0."""
        if self._live:
            raise ValueError("a batch of one row holds one sequence")
        self._solo = list(solo)
        self._live = [c for c in solo if c is not None]
        return 0

    def remove(self, row: int) -> None:
        self._solo, self._live, self._restore_to = [], [], None

    def compact(self) -> dict[int, int]:
        return {0: 0}

    def row_caches(self, row: int, make: Callable[[], Sequence[Cache | None]],
                   copy: bool = True, length: int | None = None) -> list[Cache | None] | None:
        """The sequence's caches themselves (what :meth:`BatchCaches.row_caches` copies out),
        cut back to ``length`` positions where the last round's
        rollback still allows (else None)."""
        if length is not None and length != self.row_offsets[0]:
            if self._restore_to is None or length > self._restore_to:
                return None
            self._restore_to = length  # inside the last forward: its snapshots serve
        return self.caches

    def keep_for_restore(self, length: int) -> None:
        """A forward of ``length`` tokens follows: each cache keeps every offset in it."""
        self._settle()
        start = self.row_offsets[0]
        for c in self._live:
            c.schedule_snapshots(range(start + 1, start + length + 1))

    def restore_rows(self, offsets: Sequence[int]) -> None:
        self._restore_to = offsets[0]

    def bytes_per_token(self) -> int:
        return 0  # (one sequence always runs: a budget never weighs it)

    def bytes_per_row(self) -> int:
        return 0

    def bytes_for(self, rows: int, positions: int) -> int:
        return sum(a.nbytes for a in self.state)

    @property
    def state(self) -> list[mx.array]:
        self._settle()
        return [a for c in self._live for a in c.state]
