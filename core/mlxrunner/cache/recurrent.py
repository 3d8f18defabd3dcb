"""Recurrent (linear-attention) cache: a convolution tail plus a float32 state.

A Gated DeltaNet layer keeps the last ``kernel - 1`` inputs of its causal
convolution and a recurrent state ``[B, H, Dv, Dk]``. Neither can be rolled back
by moving an offset, so the snapshot verify path works like this: before a
multi-token forward the caller schedules the offsets it may return to; the layer
asks :meth:`RecurrentCache.snapshot_positions` which interior boundaries those
are and hands :meth:`RecurrentCache.advance` a ``capture`` function built from
that forward's own intermediate arrays (for the chunked form: the chunk-start
states, decays, keys and corrected values). ``capture(j)`` expresses the conv
tail and the state after the first ``j`` tokens of that forward as a few lazy
MLX operations on those arrays; nothing is replayed token by token, and only
the boundary actually restored is ever computed.

The batched form (:class:`BatchedRecurrentCache`, tails and states stacked by row) is here
too; the prefix cache keeps a recurrent cache as a snapshot (tail and state at one offset).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from .base import Cache
from .batched import BatchedCache, _row_select, grow_rows
from .frame import TraceFrame

#: ``capture(j)`` -> (conv tail, state) after the first ``j`` tokens of the last forward
Capture = Callable[[int], tuple[mx.array, mx.array]]


@dataclass(frozen=True)
class StateCapture:
    """A capture as a pure function of arrays: ``rebuild(j, *arrays)`` gives the conv tail
    and state after the first ``j`` tokens. Unlike a closure over a forward's intermediate
    arrays, it survives a traced forward: the arrays become the trace's outputs, and only
    the boundary actually restored is ever computed. (A plain closure still works there:
    every scheduled boundary is then computed inside the trace.)"""

    rebuild: Callable[..., tuple[mx.array, mx.array]]
    arrays: tuple[mx.array, ...]

    def __call__(self, j: int) -> tuple[mx.array, mx.array]:
        return self.rebuild(j, *self.arrays)


class RecurrentCache(Cache):
    """Convolution tail ``[B, kernel - 1, channels]`` and recurrent state (float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_tail: mx.array | None = None
        self.recurrent_state: mx.array | None = None
        self._capture: Capture | None = None
        self._forward_start = 0

    def snapshot_positions(self, length: int) -> list[int]:
        """Interior boundaries ``j`` (``0 < j < length``) of the next forward of ``length``
        tokens that are scheduled for restore; the end of the forward needs no capture."""
        start = self.offset
        return [o - start for o in self.scheduled if start < o < start + length]

    def advance(self, length: int, conv_tail: mx.array, recurrent_state: mx.array,
                capture: Capture | None = None) -> None:
        """Record the state after a forward of ``length`` tokens.

        ``capture`` must answer every position :meth:`snapshot_positions` gave for
        this forward; it is kept until the next forward, restore or discard.
        """
        self._forward_start = self.offset
        self._capture = capture
        self.offset += length
        self.conv_tail = conv_tail
        self.recurrent_state = recurrent_state

    def restore(self, offset: int) -> None:
        self._check_restorable(offset)
        if offset != self.offset:
            if self._capture is None or not self._forward_start < offset < self.offset:
                raise ValueError(f"cannot restore to offset {offset}: the last forward covered "
                                 f"({self._forward_start}, {self.offset}] without capturing it")
            self.conv_tail, self.recurrent_state = self._capture(offset - self._forward_start)
            self.offset = offset
        self.discard_snapshots()

    def discard_snapshots(self) -> None:
        super().discard_snapshots()
        self._capture = None

    @property
    def state(self) -> list[mx.array]:
        if self.conv_tail is None or self.recurrent_state is None:
            return []
        return [self.conv_tail, self.recurrent_state]

    # -- traced forwards ------------------------------------------------------------------
    def trace_key(self, length: int) -> Hashable | None:
        if self.recurrent_state is None:
            return None
        return (self.recurrent_state.shape[0], tuple(self.snapshot_positions(length)))

    def trace_inputs(self, length: int) -> list[mx.array]:
        assert self.conv_tail is not None and self.recurrent_state is not None  # trace_key saw them
        arrays = [self.conv_tail, self.recurrent_state]
        self.conv_tail = self.recurrent_state = None
        return arrays

    def stand_in(self, frame: TraceFrame, arrays: Sequence[mx.array]) -> RecurrentCache:
        return TracedRecurrentCache(frame, arrays, self.snapshot_positions(frame.length),
                                    self.scheduled)

    def adopt(self, outputs: Sequence[mx.array], length: int, record: object) -> None:
        tail, state, *captured = outputs
        capture = adopted_capture(self.snapshot_positions(length), captured, record)
        self.advance(length, tail, state, capture)

    def give_back(self, inputs: Sequence[mx.array]) -> None:
        self.conv_tail, self.recurrent_state = inputs

    # -- batching and the prefix cache ------------------------------------------------------
    def batched(self) -> BatchedRecurrentCache:
        return BatchedRecurrentCache()

    def prefix_kind(self) -> str | None:
        # the exact class: a subclass may keep state this one does not know
        return "snapshot" if type(self) is RecurrentCache else None

    def prefix_snapshot(self) -> tuple[mx.array, mx.array]:
        assert self.conv_tail is not None and self.recurrent_state is not None
        return mx.contiguous(self.conv_tail), mx.contiguous(self.recurrent_state)

    def restore_prefix_snapshot(self, first: mx.array, second: mx.array, length: int) -> None:
        self.conv_tail, self.recurrent_state = mx.array(first), mx.array(second)
        self.offset = length


def adopted_capture(positions: Sequence[int], captured: Sequence[mx.array],
                    record: object) -> Capture | None:
    """The capture a traced forward's extra outputs stand for (see
    :class:`TracedRecurrentCache`): a :class:`StateCapture` over them when the trace
    recorded its rebuild, else the states at every boundary it computed."""
    if not positions:
        return None
    if callable(record):  # the rebuild of a StateCapture
        return StateCapture(record, tuple(captured))
    states = {j: (captured[2 * i], captured[2 * i + 1]) for i, j in enumerate(positions)}
    return states.__getitem__


class TracedRecurrentCache(RecurrentCache):
    """A recurrent cache inside a traced forward (a :class:`RecurrentCache`'s or a batched
    one's): the tail and state are traced inputs, and :meth:`advance` records the outputs
    and what a rollback to ``positions`` (the forward's boundaries to capture) needs."""

    def __init__(self, frame: TraceFrame, arrays: Sequence[mx.array],
                 positions: Sequence[int], scheduled: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.offset = frame.offset  # type: ignore[assignment]
        self.scheduled = scheduled
        self.conv_tail, self.recurrent_state = arrays
        self.positions = list(positions)
        self.outputs: list[mx.array] = []
        self.rebuild: Callable[..., tuple[mx.array, mx.array]] | None = None

    def snapshot_positions(self, length: int) -> list[int]:
        return list(self.positions)

    def advance(self, length: int, conv_tail: mx.array, recurrent_state: mx.array,
                capture: Capture | None = None) -> None:
        self.outputs = [conv_tail, recurrent_state]
        if not self.positions:
            return
        if capture is None:
            raise ValueError("a forward over scheduled snapshots must hand advance a capture")
        if isinstance(capture, StateCapture):
            self.rebuild = capture.rebuild
            self.outputs += list(capture.arrays)
        else:
            for j in self.positions:
                self.outputs += list(capture(j))

    def trace_outputs(self) -> list[mx.array]:
        return list(self.outputs)

    def trace_record(self) -> object:
        return self.rebuild


class BatchedRecurrentCache(BatchedCache):
    """Recurrent layers: conv tails ``[B, kernel - 1, C]`` and states ``[B, H, Dv, Dk]``
    stacked by row."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_tail: mx.array | None = None
        self.recurrent_state: mx.array | None = None
        self._capture: Callable[[int], tuple[mx.array, mx.array]] | None = None

    def _grow_rows(self, rows: int) -> None:
        if self.conv_tail is not None and self.recurrent_state is not None:
            self.conv_tail = grow_rows(self.conv_tail, rows)
            self.recurrent_state = grow_rows(self.recurrent_state, rows)

    def _copy_row(self, row: int, solo: Cache) -> None:
        if not isinstance(solo, RecurrentCache) or solo.conv_tail is None or \
                solo.recurrent_state is None:
            raise TypeError("a batched recurrent cache takes a filled RecurrentCache, got "
                            f"{type(solo).__name__}")
        if self.conv_tail is None or self.recurrent_state is None:
            self.conv_tail = mx.zeros((self.rows, *solo.conv_tail.shape[1:]),
                                      solo.conv_tail.dtype)
            self.recurrent_state = mx.zeros((self.rows, *solo.recurrent_state.shape[1:]),
                                            solo.recurrent_state.dtype)
        self.conv_tail[row:row + 1] = solo.conv_tail
        self.recurrent_state[row:row + 1] = solo.recurrent_state

    def _take_rows(self, order: mx.array, length: int) -> None:
        if self.conv_tail is not None and self.recurrent_state is not None:
            self.conv_tail = self.conv_tail[order]
            self.recurrent_state = self.recurrent_state[order]

    def fill_solo(self, row: int, solo: Cache, length: int,
                  own: Callable[[mx.array], mx.array]) -> bool:
        # a state cannot be cut back: only the row as it stands
        if type(solo) is not RecurrentCache or length != self.row_offsets[row]:
            return False
        assert self.conv_tail is not None and self.recurrent_state is not None
        solo.conv_tail = own(self.conv_tail[row:row + 1])
        solo.recurrent_state = own(self.recurrent_state[row:row + 1])
        solo.offset = length
        return True

    def bytes_per_row(self) -> int:
        if self.conv_tail is None or self.recurrent_state is None:
            return 0
        return (self.conv_tail.nbytes + self.recurrent_state.nbytes) // max(self.rows, 1)

    def snapshot_positions(self, length: int) -> list[int]:
        """Interior boundaries a capture must answer: every one, when a rollback may follow."""
        return list(range(1, length)) if self.restorable else []

    def discard_snapshots(self) -> None:
        super().discard_snapshots()
        self._capture = None

    def _restore(self, offsets: list[int], starts: tuple[int, ...]) -> None:
        assert self.conv_tail is not None and self.recurrent_state is not None
        ends = self.row_offsets
        wanted: dict[int, list[int]] = {}
        for r, (o, s, e) in enumerate(zip(offsets, starts, ends)):
            if self.live[r] and o != e:
                wanted.setdefault(o - s, []).append(r)
        if not wanted:
            return
        if self._capture is None:
            raise ValueError("restore_rows: the last forward captured no recurrent state")
        tail, state = self.conv_tail, self.recurrent_state
        for j, rows in sorted(wanted.items()):
            if j == 0:
                raise ValueError("a recurrent row keeps at least one token of a forward")
            tail_j, state_j = self._capture(j)
            pick = _row_select(rows, self.rows)
            tail = mx.where(pick[:, None, None], tail_j.astype(tail.dtype), tail)
            state = mx.where(pick[:, None, None, None], state_j.astype(state.dtype), state)
        self.conv_tail, self.recurrent_state = tail, state

    @property
    def state(self) -> list[mx.array]:
        if self.conv_tail is None or self.recurrent_state is None:
            return []
        return [self.conv_tail, self.recurrent_state]

    # -- forwards --------------------------------------------------------------------------
    def trace_key(self, length: int) -> Hashable | None:
        if self.recurrent_state is None:
            return None
        return (self.rows, tuple(self.snapshot_positions(length)))

    def trace_inputs(self, length: int) -> list[mx.array]:
        assert self.conv_tail is not None and self.recurrent_state is not None
        arrays = [self.conv_tail, self.recurrent_state]
        self.conv_tail = self.recurrent_state = None
        return arrays

    def stand_in(self, frame: TraceFrame, arrays: Sequence[mx.array]) -> Cache:
        return TracedRecurrentCache(frame, arrays, self.snapshot_positions(frame.length))

    def adopt(self, outputs: Sequence[mx.array], length: int, record: object) -> None:
        tail, state, *captured = outputs
        self._capture = adopted_capture(self.snapshot_positions(length), captured, record)
        self.conv_tail, self.recurrent_state = tail, state
        self._advanced(length)

    def give_back(self, inputs: Sequence[mx.array]) -> None:
        self.conv_tail, self.recurrent_state = inputs
