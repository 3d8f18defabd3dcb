"""Attention's per-head inputs: each head normalised, laid out ``[B, H, L, D]`` and rotated.

``q, k, v = attention_heads(offset, (q, self.q_norm, self.rope), (k, self.k_norm, self.rope),
(v, eps, None))`` is ``rope(norm(x).transpose(0, 2, 1, 3), offset)`` for each part (a
norm: an :class:`~mlxrunner.nn.RMSNorm`, a float for the weightless norm of that eps, or
None; a rope: a :class:`~mlxrunner.nn.RoPE` or None). A part's fourth entry, a size, takes
each head's leading entries: ``(q_gate, self.q_norm, self.rope, d)`` with ``q_gate [B, L, H,
2 d]`` (a query interleaved with its gate) is the part ``q_gate[..., :d]``, which the kernel
reads in place (a slice would be copied first). On CUDA a decode step's parts run as one
fused kernel where they share one RoPE; elsewhere, and for a prompt, they are the layers'
own operations.
"""

from __future__ import annotations

import math

import mlx.core as mx

from .cuda_norms import HeadPart, Rotation, fused_heads
from .kernels import on_cuda
from .norm import RMSNorm, rms_norm
from .rope import RoPE

#: a part: heads ``[B, L, H, D]``, their norm and their rotation; optionally the size of
#: each head's leading entries to take
Part = tuple[mx.array, RMSNorm | float | None, RoPE | None] | \
    tuple[mx.array, RMSNorm | float | None, RoPE | None, int]


def attention_heads(offset: int | mx.array, *parts: Part) -> list[mx.array]:
    """Each part's heads ``[B, L, H, D]`` normalised, as ``[B, H, L, D]``, rotated at
    positions from ``offset`` (see the module). ValueError where a part's heads are not
    ``[B, L, H, D]``, its parts disagree on ``B`` and ``L``, or its size is not in ``(0, D]``."""
    sizes = set()
    for i, (x, *_) in enumerate(parts):
        if x.ndim != 4 or x.shape[:2] != parts[0][0].shape[:2]:
            raise ValueError(f"attention_heads: part {i}'s heads must be [B, L, H, D] with the "
                             f"other parts' B and L, got shape {list(x.shape)}")
        size = _size(parts[i])
        if not 0 < size <= x.shape[3]:
            raise ValueError(f"attention_heads: part {i} takes {size} entries of heads of "
                             f"{x.shape[3]}")
        sizes.add(size)
    if on_cuda() and len(sizes) == 1:
        fused = _fused(offset, parts, sizes.pop())
        if fused is not None:
            return fused
    out = []
    for part in parts:
        x, norm, rope = part[:3]
        if _size(part) < x.shape[3]:
            x = x[..., :_size(part)]
        if isinstance(norm, RMSNorm):
            x = norm(x)
        elif norm is not None:
            x = rms_norm(x, norm)
        x = x.transpose(0, 2, 1, 3)
        out.append(x if rope is None else rope(x, offset))
    return out


def _size(part: Part) -> int:
    return part[3] if len(part) == 4 else part[0].shape[3]


def _fused(offset: int | mx.array, parts: tuple[Part, ...], size: int
           ) -> list[mx.array] | None:
    ropes = {id(r): r for _, _, r, *_ in parts if r is not None}
    if len(ropes) > 1:
        return None
    rotation: Rotation | None = None
    for rope in ropes.values():
        if rope.mscale != 1.0:
            return None
        freqs = rope._freqs  # (the core's own class)
        rotation = (rope.dims, rope.traditional,
                    None if freqs is not None else math.log2(rope.base), rope.scale, freqs)
    kernel_parts: list[HeadPart] = []
    for x, norm, part_rope, *_ in parts:
        if isinstance(norm, RMSNorm):
            kernel_parts.append((x, norm.applied_weight(), norm.eps, part_rope is not None))
        else:
            kernel_parts.append((x, None, None if norm is None else float(norm),
                                 part_rope is not None))
    return fused_heads(kernel_parts, rotation, offset, size)
