"""The core's layers on the host, for forwards run to generate on MLX's CPU device.

Where products run on the host (:func:`mlxrunner.nn.kernels.host_products`: MLX's CPU
device off macOS), a decode step cannot be traced and runs eagerly, and an eager step on
MLX's CPU device pays for every operation: each one is handed to MLX's stream thread and
each evaluation waits for that thread (15-45 us a hand-over on these machines), and its
fast functions fall back to separate operations there (RoPE: about 15 of them, 60-100 us
a call; attention's products through the reference BLAS: 250 us a layer at 200 keys, a
prompt's attention quadratic at that rate). So inside :func:`hosting` (which the core's
forwards for generation enter: :func:`mlxrunner.decode.step.forward` and prefill) the
core's layers compute on the host in numpy: attention, RMS norms, RoPE, gated activations,
the residual adds and the splits of a joined product. Results are new MLX arrays that are
already evaluated, so the next host layer reads them without waiting for MLX; only an
architecture's own operations in between (a reshape of heads) cost an evaluation.

Outside :func:`hosting` (a gradient, a traced forward, a plugin calling its model itself)
the layers are MLX's operations, so gradients flow through them; inside a traced forward
the host cannot read the arrays and each layer falls back the same way. Each function
here returns None where it does not apply, and its caller runs MLX's operations.

The arithmetic is MLX's, in the same order where it matters: the RMS norm in float32 then
the weight, RoPE's angles in float32 as MLX forms them, attention's queries scaled first
and a float32 softmax; results agree with MLX's within float32 rounding (tests check).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import numpy as np

from .host_build import host_kernels
from .kernels import host_products

#: a slice of queries' scores holds at most this many float32 values (4 MB: the passes over
#: them stay in the caches)
SCORES_MAX_ELEMENTS = 1 << 20

class _State(threading.local):
    active = False  # (class defaults: a missing thread-local attribute raises and catches inside)
    off = 0


_state = _State()


@contextmanager
def hosting() -> Iterator[None]:
    """Let the core's layers run on the host in this thread (see the module); whether
    products run on the host is asked once, here, not by every layer's every call."""
    held = _state.active
    _state.active = not _state.off and host_products()
    try:
        yield
    finally:
        _state.active = held


@contextmanager
def unhosted() -> Iterator[None]:
    """The core's layers as MLX's operations in this thread, even inside :func:`hosting`
    (a check comparing a traced forward with the eager one compares tracing alone)."""
    held = _state.active, _state.off
    _state.active, _state.off = False, held[1] + 1
    try:
        yield
    finally:
        _state.active, _state.off = held


def host_active() -> bool:
    """Whether this thread is inside :func:`hosting` (and not :func:`unhosted`) where
    products run on the host (one flag: asked by every layer's every call)."""
    return _state.active


def host_array(x: mx.array) -> np.ndarray | None:
    """``x`` as a float32 numpy array (a view where it can be), or None where ``x`` is
    another dtype or cannot be read (traced)."""
    if x.dtype != mx.float32:
        return None
    try:
        return np.asarray(x)
    except ValueError:  # "[eval] ... not allowed" while tracing
        return None


def host_add(y: mx.array, other: mx.array) -> mx.array | None:
    """``y + other`` on the host (float32; ``other`` broadcast to ``y``'s shape)."""
    if not host_active() or other.ndim > y.ndim or any(
            b not in (1, a) for a, b in zip(y.shape[::-1], other.shape[::-1])):
        return None
    a, b = host_array(y), host_array(other)
    if a is None or b is None:
        return None
    return mx.array(a + b)


def host_split(y: mx.array, cuts: list[int]) -> list[mx.array] | None:
    """``mx.split(y, cuts, axis=-1)`` as evaluated arrays."""
    if not host_active():
        return None
    a = host_array(y)
    if a is None:
        return None
    bounds = [0, *cuts, a.shape[-1]]
    return [mx.array(a[..., begin:end]) for begin, end in zip(bounds, bounds[1:])]


def host_rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array | None:
    """``mx.fast.rms_norm(x, weight, eps)`` for float32 ``x`` and weight."""
    if not host_active() or (weight is not None and weight.dtype != mx.float32):
        return None
    a = host_array(x)
    w = None if weight is None else host_array(weight)
    if a is None or (weight is not None and w is None):
        return None
    loops = host_kernels()
    if loops is not None and (w is None or w.shape == (a.shape[-1],)):
        return mx.array(loops.rms_norm(np.ascontiguousarray(a),
                                       None if w is None else np.ascontiguousarray(w), eps))
    y = a * (np.float32(1.0) / np.sqrt(np.mean(a * a, axis=-1, keepdims=True, dtype=np.float32)
                                       + np.float32(eps)))
    return mx.array(y if w is None else y * w)


def host_rope(x: mx.array, dims: int, *, traditional: bool, base: float | None, scale: float,
              offset: int | mx.array, freqs: mx.array | None) -> mx.array | None:
    """``mx.fast.rope`` with the same arguments for float32 ``x`` ``[..., L, D]`` and an int
    offset or one per batch row."""
    if not host_active() or dims % 2 or dims > x.shape[-1] or x.ndim < 2:
        return None
    a = host_array(x)
    if a is None:
        return None
    if isinstance(offset, mx.array):
        try:
            start = np.asarray(offset).astype(np.float32)
        except ValueError:
            return None
        if start.size > 1:  # one per batch row: [B] -> [B, 1, ..., 1] against [B, ..., L]
            if a.ndim < 3 or start.shape != (a.shape[0],):
                return None
            start = start.reshape((-1,) + (1,) * (a.ndim - 2))
        else:
            start = start.reshape(())
    else:
        start = np.float32(offset)
    half = dims // 2
    if freqs is not None:
        f = host_array(freqs)
        if f is None:
            return None
        inv = np.float32(1.0) / f
    else:
        assert base is not None
        inv = _inverse_frequencies(half, float(base))
    positions = (np.arange(a.shape[-2], dtype=np.float32) + start) * np.float32(scale)
    loops = host_kernels()
    if loops is not None and a.ndim >= 3:
        rows = positions.reshape(-1, a.shape[-2])  # [B or 1, L]
        return mx.array(loops.rope(np.ascontiguousarray(a), dims, traditional,
                                   np.ascontiguousarray(rows), np.ascontiguousarray(inv)))
    theta = positions[..., None] * inv  # [..., L, half]
    cos, sin = np.cos(theta), np.sin(theta)
    out = a.copy()
    if traditional:
        x1, x2 = a[..., 0:dims:2], a[..., 1:dims:2]
        out[..., 0:dims:2] = x1 * cos - x2 * sin
        out[..., 1:dims:2] = x1 * sin + x2 * cos
    else:
        x1, x2 = a[..., :half], a[..., half:dims]
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:dims] = x1 * sin + x2 * cos
    return mx.array(out)


@functools.lru_cache(maxsize=64)
def _inverse_frequencies(half: int, base: float) -> np.ndarray:
    # by MLX's own exp, as its RoPE forms them: numpy's differs in the last bit, which at
    # position 30000 moves an angle by 1e-3
    inv = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32)
                 * mx.array(np.log(base) / half, dtype=mx.float32))
    return np.array(inv)


def host_silu_mul(gate: mx.array, up: mx.array) -> mx.array | None:
    """``silu(gate) * up`` for float32 arrays of one shape."""
    if not host_active() or gate.shape != up.shape:
        return None
    g, u = host_array(gate), host_array(up)
    if g is None or u is None:
        return None
    loops = host_kernels()
    if loops is not None:
        return mx.array(loops.silu_mul(np.ascontiguousarray(g), np.ascontiguousarray(u)))
    return mx.array(g / (np.float32(1.0) + np.exp(-g)) * u)


def host_attention(q: mx.array, keys: mx.array, values: mx.array,
                   mask: mx.array | str | None, scale: float) -> mx.array | None:
    """``mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)`` for
    float32 queries, keys and values ``[B, H, L, D]`` with whole groups of query heads per
    key/value head; a long block of queries in slices whose scores stay within
    ``SCORES_MAX_ELEMENTS``. "causal" lines the block's last query up with the last key."""
    if not (host_active() and q.ndim == 4 and keys.ndim == 4 and values.ndim == 4
            and q.dtype == keys.dtype == values.dtype == mx.float32
            and keys.shape[1] and q.shape[1] % keys.shape[1] == 0
            and keys.shape[2] == values.shape[2]
            and (mask is None or (isinstance(mask, str) and mask == "causal") or (
                isinstance(mask, mx.array) and mask.dtype in (mx.bool_, mx.float32)))):
        return None
    try:
        qn, kn, vn = np.asarray(q), np.asarray(keys), np.asarray(values)
        mn = np.asarray(mask) if isinstance(mask, mx.array) else mask
    except ValueError:  # "[eval] ... not allowed" while tracing
        return None
    return mx.array(_attention(qn, kn, vn, mn, scale))


def _attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray,
               mask: np.ndarray | str | None, scale: float) -> np.ndarray:
    B, Hq, L, D = q.shape
    Hk, S = keys.shape[1], keys.shape[2]
    rep = Hq // Hk
    out = np.empty((B, Hk, rep, L, values.shape[-1]), np.float32)
    grouped = q.reshape(B, Hk, rep, L, D)
    if isinstance(mask, np.ndarray):
        mask = np.broadcast_to(mask, (B, Hq, L, S)).reshape(B, Hk, rep, L, S)
    step = max(1, SCORES_MAX_ELEMENTS // max(1, B * Hq * S))
    key_t = keys.swapaxes(-1, -2)  # [B, Hk, D, S]
    for begin in range(0, L, step):
        end = min(L, begin + step)
        n = end - begin
        # causal: query l sees keys up to S - L + l, so the slice reads keys [0, seen) only
        # and masks the triangle of its last n of them
        seen = max(1, S - L + end) if isinstance(mask, str) else S
        # a group's query heads as the rows of one product per key/value head
        rows = (grouped[:, :, :, begin:end] * np.float32(scale)).reshape(B, Hk, rep * n, D)
        scores = np.matmul(rows, key_t[..., :seen]).reshape(B, Hk, rep, n, seen)
        if isinstance(mask, str):
            tail = scores[..., max(0, seen - n):]
            hidden = np.arange(tail.shape[-1])[None, :] > \
                np.arange(n)[:, None] + (tail.shape[-1] - n)
            tail[..., hidden] = np.float32(-np.inf)
        elif mask is not None:
            part = mask[:, :, :, begin:end]
            if part.dtype == np.bool_:
                scores = np.where(part, scores, np.float32(-np.inf))
            else:
                scores += part.astype(np.float32)
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        total = scores.sum(axis=-1, keepdims=True)  # [B, Hk, rep, n, 1]
        # normalised after the product: n x D divisions, not n x seen
        mixed = np.matmul(scores.reshape(B, Hk, rep * n, seen), values[:, :, :seen])
        out[:, :, :, begin:end] = mixed.reshape(B, Hk, rep, n, -1) / total
    return out.reshape(B, Hq, L, values.shape[-1])
