"""Token embeddings, optionally scaled, that double as a tied output head."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .cuda_rows import table_rows
from .linear import apply_linear


class Embedding(nn.Embedding):
    """``mlx.nn.Embedding`` with an optional ``scale`` applied to what it returns (Gemma's
    ``sqrt(hidden)``, rounded to the weight's dtype as transformers rounds it) and an
    :meth:`as_linear` through :func:`mlxrunner.nn.project` (the tied head)."""

    def __init__(self, num_embeddings: int, dims: int, scale: float | None = None) -> None:
        super().__init__(num_embeddings, dims)
        self.scale = scale

    def __call__(self, ids: mx.array) -> mx.array:
        h = table_rows(self.weight, ids)  # (on CUDA: the core's kernel, built in less time)
        if h is None:
            h = super().__call__(ids)
        return h if self.scale is None else h * mx.array(self.scale, h.dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        return apply_linear(self, x)

    def to_quantized(self, group_size: int | None = None, bits: int | None = None,
                     mode: str = "affine", quantize_input: bool = False,
                     **_: object) -> nn.Module:
        # mlx annotates from_embedding's group_size and bits `int = None`
        quantized = QuantizedEmbedding.from_embedding(
            self, group_size, bits, mode=mode)  # type: ignore[arg-type]
        quantized.scale = self.scale
        return quantized


class QuantizedEmbedding(nn.QuantizedEmbedding):
    """``mlx.nn.QuantizedEmbedding`` with :class:`Embedding`'s ``scale``, whose
    :meth:`as_linear` runs where a quantized linear layer's product does."""

    scale: float | None = None

    def as_linear(self, x: mx.array) -> mx.array:
        return apply_linear(self, x)

    def __call__(self, ids: mx.array) -> mx.array:
        h = super().__call__(ids)
        return h if self.scale is None else h * mx.array(self.scale, h.dtype)
