"""Attention of a short block of queries (decode steps, verify blocks, draft blocks) over
cache buffers, for architecture and draft plugins.

MLX's fused attention (``mx.fast.scaled_dot_product_attention``) has no kernel on MLX
0.32's CUDA backend for these shapes (one or a few queries, grouped-query heads, a
boolean mask, head dims 256 and 512: checked with ``force_fused=True``), so it falls back
to operations that broadcast the keys over each group's query heads in a batched matmul
(query heads ``[B, Hk, rep, L, D]`` against keys ``[B, Hk, 1, S, D]``). On CUDA,
:func:`attend` instead folds a group's query heads into the rows of one plain batched
matmul (``[B, Hk, rep * L, D]`` against ``[B, Hk, S, D]``): the same arithmetic (the
query scaled first, a float32 softmax, the products in the inputs' type) with no
broadcast batch. Elsewhere, and for longer blocks (prompts), it is MLX's function.
"""

from __future__ import annotations

import os

import mlx.core as mx

#: the longest query block :func:`attend` folds (longer ones are prompts)
FOLD_MAX_QUERIES = 16
#: ``MLXRUNNER_FOLDED_ATTENTION=0``: always MLX's function (to compare)
ENV_SWITCH = "MLXRUNNER_FOLDED_ATTENTION"


def _cuda_default() -> bool:
    cuda = getattr(mx, "cuda", None)
    return mx.default_device() == mx.gpu and cuda is not None and cuda.is_available()


def folds(q: mx.array, keys: mx.array, mask: mx.array | str | None) -> bool:
    """Whether :func:`attend` computes this case as folded matmuls (else MLX's function)."""
    return (os.environ.get(ENV_SWITCH, "1") != "0" and _cuda_default()
            and q.ndim == 4 and q.shape[2] <= FOLD_MAX_QUERIES
            and keys.ndim == 4 and q.shape[1] % keys.shape[1] == 0
            and (mask is None or (isinstance(mask, mx.array) and mask.dtype == mx.bool_
                                  and mask.ndim <= 2)))


def folded_attention(q: mx.array, keys: mx.array, values: mx.array, *, scale: float,
                     mask: mx.array | None = None) -> mx.array:
    """``softmax(q keys^T * scale, masked) values`` with each key/value head's query heads
    folded into the rows of one batched matmul (see the module). ``mask``: None or a
    boolean array broadcastable to ``[L, S]`` (True: attend); every query row must keep
    at least one key."""
    B, Hq, L, D = q.shape
    Hk, S = keys.shape[1], keys.shape[2]
    rep = Hq // Hk
    rows = (q * mx.array(scale, dtype=q.dtype)).reshape(B, Hk, rep * L, D)
    scores = rows @ keys.swapaxes(-1, -2)  # [B, Hk, rep * L, S]
    if mask is not None:
        # row r * L + l of a group is query head r at position l: the mask's row l
        grouped = scores.reshape(B, Hk, rep, L, S)
        scores = mx.where(mask, grouped, mx.array(-mx.inf, dtype=scores.dtype)).reshape(
            B, Hk, rep * L, S)
    probs = mx.softmax(scores, axis=-1, precise=True)
    return (probs @ values).reshape(B, Hq, L, values.shape[-1])


def attend(q: mx.array, keys: mx.array, values: mx.array, *, scale: float,
           mask: mx.array | str | None = None) -> mx.array:
    """Attention of queries ``q [B, Hq, L, D]`` over ``keys [B, Hk, S, D]`` and ``values
    [B, Hk, S, Dv]`` (query head ``h`` reads key/value head ``h // (Hq // Hk)``), as
    ``mx.fast.scaled_dot_product_attention`` with the same arguments; ``[B, Hq, L, Dv]``."""
    if folds(q, keys, mask) and not isinstance(mask, str):
        return folded_attention(q, keys, values, scale=scale, mask=mask)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
