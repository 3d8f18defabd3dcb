"""Row-wise token distributions: what a draft proposes from and the sampler draws from.

It lives below the sampler (``mlxrunner.decode.sampler``) because the draft interface
(:mod:`mlxrunner.model.draft`) hands its proposals over in this form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx


@dataclass
class Distribution:
    """Row-wise distributions over the vocabulary.

    Sparse: ``ids`` [R, K] int32 (unique within a row) with ``probs`` [R, K]
    float32; tokens not listed have probability 0, as do listed entries with
    prob 0. Dense: ``ids`` is None and ``probs`` is [R, V]. Rows sum to 1.
    """

    probs: mx.array
    ids: mx.array | None = None

    @property
    def sparse(self) -> bool:
        return self.ids is not None

    @property
    def rows(self) -> int:
        return self.probs.shape[0]

    def prob_of(self, tokens: mx.array) -> mx.array:
        """Probability of ``tokens[r]`` under row r: [R] -> [R] float32."""
        tokens = tokens.reshape(-1, 1).astype(mx.int32)
        if self.ids is None:
            return mx.take_along_axis(self.probs, tokens, axis=-1)[:, 0]
        return mx.sum(mx.where(self.ids == tokens, self.probs, 0.0), axis=-1)

    def dense(self, vocab_size: int) -> mx.array:
        """The [R, V] float32 probabilities."""
        if self.ids is None:
            return self.probs
        out = mx.zeros((self.rows, vocab_size), dtype=mx.float32)
        return mx.put_along_axis(out, self.ids, self.probs, axis=-1)

    def __getitem__(self, rows: Any) -> Distribution:
        """Some rows (a slice or index array), still 2-D."""
        if isinstance(rows, int):
            rows = slice(rows, rows + 1)
        ids = None if self.ids is None else self.ids[rows]
        return Distribution(self.probs[rows], ids)
