"""Qwen3.5's multimodal rotary positions (interleaved M-RoPE) for its full-attention layers.

A prompt holding images gives each token three positions (temporal, height, width;
``positions [3, B, L]``): text tokens the same number thrice, an image's tokens their place
on its merged patch grid. Rotary frequency ``i`` (of the ``rotary_dims / 2`` the partial
rotary factor leaves) turns by one of them, as ``mrope_section`` (default ``[11, 11, 10]``)
interleaves them: the height position where ``i % 3 == 1`` and ``i < 3 * section[1]``, the
width position where ``i % 3 == 2`` and ``i < 3 * section[2]``, else the temporal one. The
angles ``position * theta^(-2i / rotary_dims)`` (float32) rotate the first ``rotary_dims`` of
each head in the rotate-half convention, the same table over both halves; the rest of the
head passes through. Where the three positions agree this is the plain RoPE the model runs
without ``positions``.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

#: transformers' ``Qwen3_5TextRotaryEmbedding`` default (Qwen3.5's released configs say it)
DEFAULT_SECTION = (11, 11, 10)


def frequency_components(half: int, section: Sequence[int]) -> np.ndarray:
    """Which position component (0 temporal, 1 height, 2 width) each of ``half`` rotary
    frequencies turns by."""
    out = np.zeros(half, np.int32)
    for component in (1, 2):
        out[component:3 * int(section[component]):3] = component
    return out


class MRoPE:
    """The rotation tables of ``positions`` (a plain object, not a module: nothing here is
    loaded)."""

    def __init__(self, dims: int, base: float, section: Sequence[int]) -> None:
        exponents = np.arange(0, dims, 2, dtype=np.float32) / np.float32(dims)
        # float32 as transformers computes its inverse frequencies
        self._inv_freq = mx.array((np.float32(1.0) / np.float32(base) ** exponents)
                                  .astype(np.float32))
        self._components = mx.array(frequency_components(dims // 2, section))

    def tables(self, positions: mx.array) -> tuple[mx.array, mx.array]:
        """``(cos, sin)`` float32 ``[B, 1, L, dims]`` for ``positions [3, B, L]``."""
        chosen = mx.take(positions.astype(mx.float32), self._components, axis=0)  # [dims/2, B, L]
        angles = chosen.transpose(1, 2, 0) * self._inv_freq
        angles = mx.concatenate([angles, angles], axis=-1)[:, None]
        return mx.cos(angles), mx.sin(angles)


def rotate(x: mx.array, tables: tuple[mx.array, mx.array]) -> mx.array:
    """``x [B, heads, L, head_dim]``, its first ``dims`` rotated by ``tables`` (from
    :meth:`MRoPE.tables`; rotate-half), the rest as it is."""
    cos, sin = tables
    d = cos.shape[-1]
    half = d // 2
    rot = x[..., :d].astype(mx.float32)
    turned = mx.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    out = (rot * cos + turned * sin).astype(x.dtype)
    return out if d == x.shape[-1] else mx.concatenate([out, x[..., d:]], axis=-1)
