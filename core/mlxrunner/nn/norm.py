"""RMS norms: plain, zero-centred (the weight is stored as ``w`` and applied as
``offset + w``) and gated (``norm(x) * weight * silu(gate)``)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import cuda_norms, cuda_products
from .cuda_norms import fused_add_norm
from .cuda_products import current, fused_add_normed, fused_norm
from .derived import derived
from .host_ops import host_active, host_rms_norm

#: rows past which no kernel of the core takes a norm (a prompt's): MLX's norm at once,
#: without the questions a decode step's rows need (a prompt's build is Python's time)
_KERNEL_ROWS = max(cuda_norms.MAX_ROWS, cuda_products.MAX_ROWS)


def _prompt_rows(x: mx.array) -> bool:
    return x.ndim > 0 and x.size > _KERNEL_ROWS * x.shape[-1] and not host_active()


class RMSNorm(nn.Module):
    """``rms_norm(x) * (offset + weight)``: ``offset`` 0 for the usual norm, 1 for the
    zero-centred norms of Qwen3.5 and Gemma 2/3 checkpoints (``1 + w`` is computed once, in
    float32 and rounded to the weight's dtype as transformers computes it, and held)."""

    def __init__(self, dims: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = mx.zeros((dims,)) if offset else mx.ones((dims,))
        self.eps = float(eps)
        self.offset = float(offset)

    def applied_weight(self) -> mx.array:
        if not self.offset:
            return self.weight
        return derived(self, "applied_weight", (self.weight,), lambda w: (
            w.astype(mx.float32) + self.offset).astype(w.dtype))

    def __call__(self, x: mx.array) -> mx.array:
        """``rms_norm(x) * weight``; on CUDA, where ``x`` is a decode step's fused product
        output (a residual sum or a post norm's add), written by that product's launch."""
        weight = self.applied_weight()
        if _prompt_rows(x):
            return mx.fast.rms_norm(x, weight, self.eps)
        fused = fused_norm(x, weight, self.eps)
        if fused is not None:
            return fused
        x = current(x)
        hosted = host_rms_norm(x, weight, self.eps)
        if hosted is not None:
            return hosted
        return mx.fast.rms_norm(x, weight, self.eps)

    def add_normed(self, residual: mx.array, x: mx.array, scale: mx.array | None = None
                   ) -> mx.array:
        """``(residual + self(x)) * scale`` (a post-norm's residual add; ``scale``: a
        one-element array, or None for none): one fused kernel on CUDA (a decode step's
        rows or a prompt's), or none of its own where ``x`` is a decode step's fused product
        output (its launch does it)."""
        weight = self.applied_weight()
        if _prompt_rows(x):
            # (a prompt's rows on CUDA: one launch for the norm, the add and the scale)
            fused = fused_add_norm(residual, x, weight, self.eps, scale)
            if fused is not None:
                return fused
            normed = mx.fast.rms_norm(x, weight, self.eps)
        else:
            residual = current(residual)
            fused = fused_add_normed(residual, x, weight, self.eps, scale)
            if fused is None:
                fused = fused_add_norm(residual, x, weight, self.eps, scale)
            if fused is not None:
                return fused
            normed = self(x)
        out = residual + normed
        return out if scale is None else out * scale


def rms_norm(x: mx.array, eps: float = 1e-6) -> mx.array:
    """The weightless RMS norm ``x / rms(x)``."""
    x = current(x)  # (a stream another norm's launch wrote again: read that launch's)
    hosted = host_rms_norm(x, None, eps)
    return mx.fast.rms_norm(x, None, eps) if hosted is None else hosted


@mx.compile
def _gated(normed: mx.array, gate: mx.array) -> mx.array:
    return normed * nn.silu(gate)


def gated_rms_norm(x: mx.array, gate: mx.array, weight: mx.array, eps: float) -> mx.array:
    """``rms_norm(x) * weight * silu(gate)`` (Gated DeltaNet's output norm)."""
    return _gated(mx.fast.rms_norm(x, weight, eps), gate)
