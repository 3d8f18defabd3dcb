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

from collections.abc import Callable

import mlx.core as mx

from .base import Cache

#: ``capture(j)`` -> (conv tail, state) after the first ``j`` tokens of the last forward
Capture = Callable[[int], tuple[mx.array, mx.array]]


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
        if self.recurrent_state is None:
            return []
        return [self.conv_tail, self.recurrent_state]
