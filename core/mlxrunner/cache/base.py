"""The cache contract shared by every layer kind.

The speculative round runs one target forward over ``[current, d_0 .. d_{N-1}]``
and then keeps only the accepted prefix. Before that forward it calls
``schedule_snapshots`` with the absolute offsets it may roll back to; the
layer captures whatever it needs at those offsets *during* the forward (never
by running token by token); afterwards ``restore(offset)`` puts the cache into
exactly the state a plain run over the committed tokens would have left.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx


class Cache:
    """Base class: an offset (tokens seen) plus snapshot scheduling."""

    def __init__(self) -> None:
        self.offset = 0
        self.scheduled: tuple[int, ...] = ()

    def schedule_snapshots(self, offsets: Sequence[int]) -> None:
        """Absolute offsets (each in ``(offset, offset + L]`` for the next forward of ``L``
        tokens) that the next forward must make restorable."""
        self.scheduled = tuple(sorted(int(o) for o in offsets))

    def restore(self, offset: int) -> None:
        """Roll back to ``offset``: the current offset or one scheduled before the last forward."""
        raise NotImplementedError

    def discard_snapshots(self) -> None:
        """Forget scheduled and captured snapshots (after a restore or a committed round)."""
        self.scheduled = ()

    @property
    def state(self) -> list[mx.array]:
        """Arrays to evaluate together with the outputs."""
        return []

    def _check_restorable(self, offset: int) -> None:
        if offset != self.offset and offset not in self.scheduled:
            raise ValueError(f"cannot restore to offset {offset}: current {self.offset}, "
                             f"scheduled {list(self.scheduled)}")
