"""What the caches of one traced forward share: the offset as a traced value, and the
attention masks over fixed-size buffers that go with the keys they hand out.

A traced forward (the core's compiled decode step and verify block) runs with every cache
replaced by a stand-in of the same class: its ``offset`` is a traced int32 scalar, its
buffers have a fixed size (so one trace serves every offset until a buffer grows), and
what it hands out from ``update_and_fetch`` is the whole buffer. Attention over a whole
buffer needs a validity mask; the stand-in registers the keys it handed out with the mask
that makes them exact, and :meth:`TraceFrame.mask_for` finds it again (the model's own
``mask`` argument, "causal" or None, described the exact-length keys of an eager forward).

The frame being traced is the calling thread's own (:func:`active_frame`): two models may
trace at once on two threads. Buffers that traced forwards attend over grow through few
sizes (:func:`trace_capacity`), each size a trace of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx

from ..constants import arange_constant


class Untraceable(Exception):
    """This forward cannot be traced (it runs eagerly): what the model did with a cache
    stand-in has no traced equivalent."""


class TraceFrame:
    """One traced forward of ``length`` tokens starting at the traced ``offset``."""

    def __init__(self, offset: mx.array, length: int) -> None:
        self.offset = offset
        self.length = length
        self._masks: dict[Any, mx.array] = {}
        self._mask_pairs: dict[Any, tuple[mx.array, mx.array]] = {}
        # id(keys) -> (keys, causal mask, all-valid mask): keys a stand-in handed out
        self._handed: dict[int, tuple[mx.array, mx.array | None, mx.array | None]] = {}

    # -- masks -------------------------------------------------------------------------
    def queries(self) -> mx.array:
        """Positions of the forward's tokens ``[L]``."""
        if "queries" not in self._masks:
            self._masks["queries"] = self.offset + arange_constant(self.length)
        return self._masks["queries"]

    def write_slots(self, shape: tuple[int, ...], window: int | None = None) -> mx.array:
        """Where the forward's rows ``[B, H, L, D]`` (``shape``) go along axis 2 of a
        buffer, as ``mx.put_along_axis`` takes them: their positions, or with ``window`` their
        slots in a ring of that many. (One scatter kernel on CUDA, where MLX's dynamic slice
        update launches two; the indices are made once a forward.)"""
        key = ("slots", tuple(shape), window)
        if key not in self._masks:
            rows = self.queries() if window is None else mx.remainder(self.queries(), window)
            self._masks[key] = slots_along(rows, shape)
        return self._masks[key]

    def buffer_masks(self, size: int) -> tuple[mx.array, mx.array]:
        """For a buffer whose slot ``j`` holds position ``j``: (causal ``[L, size]``,
        written ``[1, size]``)."""
        key = ("buffer", size)
        if key not in self._mask_pairs:
            slots = arange_constant(size)
            causal = slots[None] <= self.queries()[:, None]
            written = slots[None] < self.offset + self.length
            self._mask_pairs[key] = (causal, written)
        return self._mask_pairs[key]

    def ring_masks(self, window: int, full: bool) -> tuple[mx.array | None, mx.array | None]:
        """A one-token write into a ring of ``window`` slots, then attention over the ring
        as it stands: (mask or None once every slot is in the window, same)."""
        if self.length != 1:
            raise ValueError("ring_masks is for one-token forwards")
        if full:
            return None, None
        key = ("ring1", window)
        if key not in self._masks:
            self._masks[key] = (arange_constant(window) <= self.offset)[None]
        return self._masks[key], self._masks[key]

    def block_ring_mask(self, window: int) -> mx.array:
        """A block of L <= window tokens attends over the ring before its write (slot
        ``s`` holds position ``(offset - 1) - ((offset - 1 - s) mod window)``, negative
        where never written) followed by the block itself: ``[L, window + L]``."""
        key = ("ring", window)
        if key not in self._masks:
            slots = arange_constant(window)
            held = (self.offset - 1) - mx.remainder(self.offset - 1 - slots, window)
            pos = mx.concatenate([held, self.queries()])
            q = self.queries()[:, None]
            self._masks[key] = (pos >= 0) & (pos <= q) & (pos > q - window)
        return self._masks[key]

    # -- keys handed out ------------------------------------------------------------------
    def hand_out(self, keys: mx.array, causal: mx.array | None,
                 written: mx.array | None) -> None:
        self._handed[id(keys)] = (keys, causal, written)

    def mask_for(self, keys: mx.array, mask: Any) -> Any:
        """The mask that makes attention of this forward's queries over ``keys`` (as handed
        out by a stand-in) what the eager forward's attention with ``mask`` computes."""
        entry = self._handed.get(id(keys))
        if entry is None or entry[0] is not keys:
            return mask
        _, causal, written = entry
        if isinstance(mask, str) and mask == "causal":
            return causal
        if mask is None:
            return written
        if mask is causal or mask is written:
            return mask
        if isinstance(mask, mx.array):
            # the model's own mask over the keys of an eager forward, which end at the last
            # written position: restricted to the written slots, it is exact for masks of
            # absolute positions (the check of a trace's first calls finds any other)
            if written is None:
                return mask
            if mask.dtype == mx.bool_:
                return mask & written
            return mx.where(written, mask, mx.array(-mx.inf, dtype=mask.dtype))
        raise Untraceable(f"an attention mask of type {type(mask).__name__}")


def slots_along(rows: mx.array, shape: tuple[int, ...]) -> mx.array:
    """Indices for ``mx.put_along_axis(buffer, ..., update, axis=2)`` writing an update of
    ``shape`` ``[B, H, L, D]`` at slots ``rows [L]``."""
    return mx.broadcast_to(rows.reshape(1, 1, -1, 1), shape)


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


class _Local(threading.local):
    frame: TraceFrame | None = None


_local = _Local()


def active_frame() -> TraceFrame | None:
    """The frame this thread is tracing a forward in, or None."""
    return _local.frame


@contextmanager
def framing(frame: TraceFrame) -> Iterator[None]:
    """``frame`` is this thread's :func:`active_frame` inside the block."""
    before = active_frame()
    _local.frame = frame
    try:
        yield
    finally:
        _local.frame = before
