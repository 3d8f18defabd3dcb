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
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from .base import Cache
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

    def adopt(self, inputs: Sequence[mx.array], outputs: Sequence[mx.array], length: int,
              record: object) -> None:
        tail, state, *captured = outputs
        capture = adopted_capture(self.snapshot_positions(length), captured, record)
        self.advance(length, tail, state, capture)


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

    def give_back(self, inputs: Sequence[mx.array]) -> None:
        self.conv_tail, self.recurrent_state = inputs


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
