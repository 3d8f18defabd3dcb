"""The context caches of block drafts (DFlash-style): keys and values of every committed
token's context row, per draft layer, with each round's block written after them and gone
with the next commit.

:class:`TracedContext` is the same cache inside a traced block or commit (see
:class:`mlxrunner.plugin.BlockDraft`, which runs them).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..constants import arange_constant
from .frame import bucket_capacity, slots_along


class ContextCache:
    """One block-draft layer's context keys/values, rows at absolute positions
    ``start .. end-1``.

    The round's block is written just after the context (:meth:`with_block`)
    without advancing it, so the next :meth:`append` overwrites it: the block
    leaves nothing behind. A sliding layer keeps only the rows its window can
    still reach.
    """

    step = 256

    def __init__(self, window: int | None) -> None:
        self.window = window
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.start = 0
        self.length = 0

    @property
    def end(self) -> int:
        return self.start + self.length

    def reserve(self, extra: int, like_k: mx.array, like_v: mx.array) -> None:
        """Room for ``extra`` rows after the context. Capacity is one of
        :func:`bucket_capacity`'s sizes, so a traced block sees few distinct buffer shapes."""
        need = self.length + extra
        if self.keys is not None and need <= self.keys.shape[2] and \
                self.keys.shape[2] == bucket_capacity(self.keys.shape[2], self.step):
            return
        B, H, _, Dk = like_k.shape
        size = bucket_capacity(need, self.step)
        keys = mx.zeros((B, H, size, Dk), like_k.dtype)
        values = mx.zeros((B, like_v.shape[1], size, like_v.shape[3]), like_v.dtype)
        if self.keys is not None and self.values is not None and self.length:
            keys[..., :self.length, :] = self.keys[..., :self.length, :]
            values[..., :self.length, :] = self.values[..., :self.length, :]
        self.keys, self.values = keys, values

    def make_room(self, m: int, like_k: mx.array, like_v: mx.array) -> None:
        """Before appending ``m`` rows: drop what no window can reach, reserve the rest."""
        if self.window is not None and self.keys is not None and self.values is not None and \
                self.length + m > 2 * self.window:
            # Rows more than a window behind the newest can never be attended again;
            # dropping them once per window of appends keeps the copy amortised.
            keep = min(self.length, max(self.window - 1 - m, 0))
            drop = self.length - keep
            if drop > 0:
                self.keys = self.keys[..., drop:self.length, :]
                self.values = self.values[..., drop:self.length, :]
                self.start += drop
                self.length = keep
        self.reserve(m, like_k, like_v)

    def append(self, keys: mx.array, values: mx.array) -> None:
        m = keys.shape[2]
        self.make_room(m, keys, values)
        assert self.keys is not None and self.values is not None  # reserved
        self.keys[..., self.length:self.length + m, :] = keys
        self.values[..., self.length:self.length + m, :] = values
        self.length += m

    def with_block(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Context rows followed by the block's rows (the context does not advance)."""
        n = keys.shape[2]
        self.reserve(n, keys, values)
        assert self.keys is not None and self.values is not None  # reserved
        self.keys[..., self.length:self.length + n, :] = keys
        self.values[..., self.length:self.length + n, :] = values
        end = self.length + n
        return self.keys[..., :end, :], self.values[..., :end, :]

    def block_mask(self, pos: int, block: int, causal: bool) -> mx.array | None:
        """Which of the rows :meth:`with_block` returns a block row may attend (None: all)."""
        ctx = self.length
        # every context row within the window of the last block row: nothing to mask
        in_window = self.window is None or (pos + block - 1) - self.start < self.window
        if in_window and not causal:
            return None
        query = pos + arange_constant(block)[:, None]
        if ctx:
            ctx_pos = self.start + arange_constant(ctx)[None]
            if self.window is not None:
                ctx_ok = (query - ctx_pos) < self.window
            else:
                ctx_ok = mx.ones((block, ctx), dtype=mx.bool_)
        else:
            ctx_ok = mx.zeros((block, 0), dtype=mx.bool_)
        if causal:
            blk_ok = arange_constant(block)[None] <= arange_constant(block)[:, None]
        else:
            blk_ok = mx.ones((block, block), dtype=mx.bool_)
        return mx.concatenate([mx.broadcast_to(ctx_ok, (block, ctx)), blk_ok], axis=1)


class TracedContext:
    """A :class:`ContextCache` inside a traced block: the whole buffer and the context's length
    and first position as arrays, so one trace serves every round until the buffer grows.
    The block is written at ``length`` (as :meth:`ContextCache.with_block` does) and attention
    reads the whole buffer under a validity mask."""

    def __init__(self, keys: mx.array, values: mx.array, length: mx.array, start: mx.array,
                 window: int | None, masks: dict[Any, mx.array] | None = None) -> None:
        self.keys, self.values = keys, values
        self.length, self.start, self.window = length, start, window
        # Layers with one window hold the same rows (same length and start), so one mask
        # serves them all: ``masks`` is shared by the stores of one traced block.
        self.masks = {} if masks is None else masks

    def with_block(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Writes rows at ``length`` (a block, or the rows a commit appends)."""
        self.keys = mx.put_along_axis(self.keys, self._slots(keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, self._slots(values.shape), values, axis=2)
        return self.keys, self.values

    def _slots(self, shape: tuple[int, ...]) -> mx.array:
        # one scatter where a dynamic slice update launches two kernels on CUDA (see
        # mlxrunner.cache.frame.TraceFrame.write_slots); shared like the masks
        key = ("slots", self.window, tuple(shape))
        if key not in self.masks:
            self.masks[key] = slots_along(self.length.reshape(1) + arange_constant(shape[2]),
                                          shape)
        return self.masks[key]

    def block_mask(self, pos: mx.array, block: int, causal: bool) -> mx.array:
        key = (self.window, self.keys.shape[2], block, causal)
        if key not in self.masks:
            self.masks[key] = self._mask(pos, block, causal)
        return self.masks[key]

    def _mask(self, pos: mx.array, block: int, causal: bool) -> mx.array:
        row = arange_constant(self.keys.shape[2])[None]  # row j: position start + j
        query = arange_constant(block)[:, None]
        in_context = row < self.length
        if self.window is not None:
            in_context &= (pos + query) - (self.start + row) < self.window
        in_block = (row >= self.length) & (row < self.length + block)
        if causal:
            in_block &= row - self.length <= query
        return in_context | in_block


class RowContext:
    """The context of many sequences' block drafts inside a traced graph, one row each
    (continuous batching): slot ``j`` of row ``b`` holds position ``j``, and row ``b``'s
    context is its first ``lengths[b]`` slots. Rows are written at their own lengths; a
    block's queries of row ``b`` are at positions ``lengths[b] ..``; the window, if any,
    is applied by the mask."""

    def __init__(self, keys: mx.array, values: mx.array, lengths: mx.array,
                 window: int | None, masks: dict[Any, mx.array] | None = None) -> None:
        self.keys, self.values = keys, values
        self.lengths, self.window = lengths, window
        # as in TracedContext: the layers of one window share the mask
        self.masks = {} if masks is None else masks

    def with_block(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Writes each row's ``m`` rows at its length (a block, or a commit's rows)."""
        at = (self.lengths[:, None] + arange_constant(keys.shape[2])[None])[:, None, :, None]
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(at, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(at, values.shape), values,
                                        axis=2)
        return self.keys, self.values

    def block_mask(self, pos: mx.array, block: int, causal: bool) -> mx.array:
        """``[B, 1, block, S]``: each row's context (within the window) and its block."""
        key = (self.window, self.keys.shape[2], block, causal)
        if key not in self.masks:
            self.masks[key] = self._mask(block, causal)
        return self.masks[key]

    def _mask(self, block: int, causal: bool) -> mx.array:
        slot = arange_constant(self.keys.shape[2])[None, None]  # [1, 1, S]
        query = arange_constant(block)[None, :, None]  # [1, L, 1]
        length = self.lengths[:, None, None]  # [B, 1, 1]: the block's first position
        in_context = slot < length
        if self.window is not None:
            in_context &= (length + query) - slot < self.window
        in_block = (slot >= length) & (slot < length + block)
        if causal:
            in_block &= slot - length <= query
        return (in_context | in_block)[:, None]
