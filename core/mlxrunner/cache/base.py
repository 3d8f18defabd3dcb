"""The cache contract shared by every layer kind.

The speculative round runs one target forward over ``[current, d_0 .. d_{N-1}]``
and then keeps only the accepted prefix. Before that forward it calls
``schedule_snapshots`` with the absolute offsets it may roll back to; the
layer captures whatever it needs at those offsets *during* the forward (never
by running token by token); afterwards ``restore(offset)`` puts the cache into
exactly the state a plain run over the committed tokens would have left.

A kind also says how it is batched (:meth:`Cache.batched`) and how the prefix cache keeps
it (:meth:`Cache.prefix_kind`); see docs/batching.md, "Adding a cache kind".
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:  # pragma: no cover
    from .batched import BatchedCache
    from .frame import TraceFrame


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

    # -- traced forwards ------------------------------------------------------------------
    # The core traces short forwards through filled caches (decode steps, verify blocks):
    # each cache hands its arrays in as inputs, the model runs on a stand-in of the same
    # class (offset traced, fixed-size buffers) and the cache adopts what comes out.

    def trace_key(self, length: int) -> Hashable | None:
        """What a traced forward of ``length`` tokens through this cache depends on besides
        its inputs' shapes, or None when none can run now (the forward runs eagerly). A
        cache class without an implementation is never traced."""
        return None

    def trace_inputs(self, length: int) -> list[mx.array]:
        """The arrays a traced forward of ``length`` tokens takes (made ready eagerly: a
        buffer may grow); the cache lets go of those the forward may overwrite."""
        raise NotImplementedError

    def stand_in(self, frame: TraceFrame, arrays: Sequence[mx.array]) -> Cache:
        """The cache the model sees inside the traced forward, over the traced ``arrays``."""
        raise NotImplementedError

    def trace_outputs(self) -> list[mx.array]:
        """(On a stand-in, after the model ran) the arrays the cache adopts."""
        raise NotImplementedError

    def trace_record(self) -> object:
        """(On a stand-in, after the model ran) what :meth:`adopt` needs to know of the
        trace besides its outputs; kept with the traced forward, which later calls
        replay without running Python."""
        return None

    def adopt(self, outputs: Sequence[mx.array], length: int, record: object) -> None:
        """Take a traced forward's outputs for this cache (``record``: what the stand-in
        recorded): afterwards the cache is as the eager forward of ``length`` tokens leaves
        it. What it handed on in :meth:`trace_inputs` is gone (a write may have reused it):
        keep there what this needs of the state before."""
        raise NotImplementedError

    def give_back(self, inputs: Sequence[mx.array]) -> None:
        """A traced forward did not run: take back the arrays :meth:`trace_inputs` gave."""
        raise NotImplementedError

    # -- batching -----------------------------------------------------------------------
    def batched(self) -> BatchedCache:
        """A new, empty batched cache that holds rows of what this cache holds for one
        sequence (:class:`~.batched.BatchCaches`)."""
        name = type(self).__name__
        raise TypeError(f"no batched form of {name} (KVCache, RingCache and RecurrentCache "
                        "have one)")

    # -- the prefix cache (mlxrunner.cache.prefix) ----------------------------------------
    def prefix_kind(self) -> str | None:
        """How the prefix cache keeps this cache: "kv" (keys and values per position:
        :meth:`prefix_rows`, :meth:`fill_prefix`), "snapshot" (the whole state at one offset:
        :meth:`prefix_snapshot`, :meth:`restore_prefix_snapshot`), or None (it cannot)."""
        return None

    def prefix_rows(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        """("kv") Keys and values of positions ``[start, end)``, in arrays of their own."""
        raise NotImplementedError

    def fill_prefix(self, keys: mx.array, values: mx.array, length: int) -> None:
        """("kv", on a new cache) Hold ``keys`` and ``values`` (at least ``length``
        positions) as a run over ``length`` tokens leaves them."""
        raise NotImplementedError

    def prefix_snapshot(self) -> tuple[mx.array, mx.array]:
        """("snapshot") The whole state at the current offset, in arrays of their own."""
        raise NotImplementedError

    def restore_prefix_snapshot(self, first: mx.array, second: mx.array, length: int) -> None:
        """("snapshot", on a new cache) Hold what :meth:`prefix_snapshot` gave at offset
        ``length`` (copies of it: the prefix cache keeps the arrays for other lookups)."""
        raise NotImplementedError

    def _check_restorable(self, offset: int) -> None:
        if offset != self.offset and offset not in self.scheduled:
            raise ValueError(f"cannot restore to offset {offset}: current {self.offset}, "
                             f"scheduled {list(self.scheduled)}")
