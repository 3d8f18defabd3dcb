"""Attention's per-head inputs: each head normalised, laid out ``[B, H, L, D]`` and rotated.

``q, k, v = attention_heads(offset, (q, self.q_norm, self.rope), (k, self.k_norm, self.rope),
(v, eps, None))`` is ``rope(norm(x).transpose(0, 2, 1, 3), offset)`` for each part (a
norm: an :class:`~mlxrunner.nn.RMSNorm`, a float for the weightless norm of that eps, or
None; a rope: a :class:`~mlxrunner.nn.RoPE` or None). A part's fourth entry takes part of
each head: a size ``d`` (its first ``d`` entries) or a slice. With ``q_gate [B, L, H, 2 d]``
(each head's query, then its gate), ``(q_gate, self.q_norm, self.rope, d)`` is the query
part and ``(q_gate, None, None, slice(d, None))`` the gate laid out as heads; the kernel
reads them in place (a slice would be copied first). On CUDA the parts run as one fused
kernel where they share one RoPE and one head size (a decode step, a verify block, one
sequence's prompt chunk); elsewhere they are the layers' own operations.
"""

from __future__ import annotations

import math

import mlx.core as mx

from .cuda_norms import HeadPart, Rotation, fused_heads
from .kernels import on_cuda
from .norm import RMSNorm, rms_norm
from .rope import RoPE

#: a part: heads ``[B, L, H, D]``, their norm and their rotation; optionally what to take
#: of each head (a size: its leading entries; or a slice)
Part = tuple[mx.array, RMSNorm | float | None, RoPE | None] | \
    tuple[mx.array, RMSNorm | float | None, RoPE | None, int | slice]


def attention_heads(offset: int | mx.array, *parts: Part) -> list[mx.array]:
    """Each part's heads ``[B, L, H, D]`` normalised, as ``[B, H, L, D]``, rotated at
    positions from ``offset`` (see the module). ValueError where a part's heads are not
    ``[B, L, H, D]``, its parts disagree on ``B`` and ``L``, or what it takes of each head is
    not a non-empty run of its entries."""
    taken = []
    for i, (x, *_) in enumerate(parts):
        if x.ndim != 4 or x.shape[:2] != parts[0][0].shape[:2]:
            raise ValueError(f"attention_heads: part {i}'s heads must be [B, L, H, D] with the "
                             f"other parts' B and L, got shape {list(x.shape)}")
        taken.append(_taken(parts[i], i))
    if on_cuda() and len({size for _, size in taken}) == 1:
        fused = _fused(offset, parts, taken)
        if fused is not None:
            return fused
    out = []
    for part, (start, size) in zip(parts, taken):
        x, norm, rope = part[:3]
        if size < x.shape[3]:
            x = x[..., start:start + size]
        if isinstance(norm, RMSNorm):
            x = norm(x)
        elif norm is not None:
            x = rms_norm(x, norm)
        x = x.transpose(0, 2, 1, 3)
        out.append(x if rope is None else rope(x, offset))
    return out


def _taken(part: Part, i: int) -> tuple[int, int]:
    """(first entry, entries) that ``part`` takes of each of its heads."""
    width = part[0].shape[3]
    if len(part) == 3:
        return 0, width
    what = part[3]
    if isinstance(what, slice):
        start, stop, step = what.indices(width)
    elif isinstance(what, int) and not isinstance(what, bool):
        start, stop, step = 0, what, 1
    else:
        start = stop = step = 0
    if step != 1 or not 0 <= start < stop <= width:
        raise ValueError(f"attention_heads: part {i} takes {what!r} of heads of {width} "
                         "(a size or a slice of consecutive entries)")
    return start, stop - start


def _fused(offset: int | mx.array, parts: tuple[Part, ...], taken: list[tuple[int, int]]
           ) -> list[mx.array] | None:
    ropes = {id(r): r for _, _, r, *_ in parts if r is not None}
    if len(ropes) > 1:
        return None
    rotation: Rotation | None = None
    for rope in ropes.values():
        if rope.mscale != 1.0:
            return None
        freqs = rope.freqs
        rotation = (rope.dims, rope.traditional,
                    None if freqs is not None else math.log2(rope.base), rope.scale, freqs)
    kernel_parts: list[HeadPart] = []
    for x, norm, part_rope, *_ in parts:
        if isinstance(norm, RMSNorm):
            kernel_parts.append((x, norm.applied_weight(), norm.eps, part_rope is not None))
        else:
            kernel_parts.append((x, None, None if norm is None else float(norm),
                                 part_rope is not None))
    return fused_heads(kernel_parts, rotation, offset, taken[0][1], [t[0] for t in taken])
