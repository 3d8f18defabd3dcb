"""Arrays a traced function holds as constants.

Inside a traced (``mx.compile``) function, ``mx.arange(n)`` or ``mx.array([...])`` is an
operation replayed on every call. These make the array once per value, evaluated, so a
trace holds it as a constant, and a kernel input made this way is not copied from the host
on every launch.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache, lru_cache

import mlx.core as mx


class _Compiling(threading.local):
    depth = 0  # (class defaults: a missing thread-local attribute raises and catches inside)


_compiling = _Compiling()


@contextmanager
def compiling() -> Iterator[None]:
    """This thread calls a function compiled with ``mx.compile`` (whose first call in a
    thread traces it): an array made and evaluated meanwhile is a constant every call
    reuses; one left lazy is an operation every call runs again, and MLX's compile merges
    equal ones."""
    depth = _compiling.depth
    _compiling.depth = depth + 1
    try:
        yield
    finally:
        _compiling.depth = depth


def in_compiled() -> bool:
    """Whether this thread is inside :func:`compiling`."""
    return _compiling.depth > 0


#: the fewest bytes a constant's buffer holds (see :func:`constant`)
MIN_CONSTANT_BYTES = 16


def padding_entries(count: int, dtype: mx.Dtype) -> int:
    """How many entries of ``dtype`` past ``count`` fill :data:`MIN_CONSTANT_BYTES`."""
    return max(0, -(-MIN_CONSTANT_BYTES // dtype.size) - count)


@cache
def constant(values: tuple[int | float | bool, ...], dtype: mx.Dtype) -> mx.array:
    """``mx.array(values, dtype)``, made and evaluated once per (values, dtype).

    Its buffer holds at least :data:`MIN_CONSTANT_BYTES` (the array is a view of the first
    entries): MLX on CUDA serves arrays of at most 8 bytes from one pool of managed memory
    whose pages the host writes every step (a step's offset), so a kernel reading a small
    constant there may read across the bus; a larger buffer is an allocation of its own,
    which moves to the GPU at its first use and stays."""
    return _made(values, dtype)


def _made(values: tuple[int | float | bool, ...], dtype: mx.Dtype) -> mx.array:
    padding = padding_entries(len(values), dtype)
    array = mx.array(values + (0,) * padding, dtype=dtype)
    if padding:
        array = array[:len(values)]
    mx.eval(array)
    return array


@lru_cache(maxsize=8)  # (a prompt chunk's layers share one; each chunk has its own)
def position_constant(position: int) -> mx.array:
    """``mx.array([position], int32)`` as :func:`constant` makes it, kept for the last few
    positions only: a chunk's layers ask it once each, and positions do not recur."""
    return _made((position,), mx.int32)


@cache
def arange_constant(n: int) -> mx.array:
    """``mx.arange(n)`` (int32), made and evaluated once per ``n``."""
    array = mx.arange(n, dtype=mx.int32)
    mx.eval(array)
    return array


@lru_cache(maxsize=4)  # (a prompt's first chunk, the chunks after, its last)
def window_mask(kept: int, n: int, window: int) -> mx.array:
    """The mask of ``n`` new queries over ``kept`` older keys and their own, ``[n, kept +
    n]``: causal, each query seeing its last ``window`` keys; made and evaluated once per
    (kept, n, window), so a prompt's sliding layers share one array."""
    keys = mx.arange(-kept, n)
    queries = mx.arange(n)[:, None]
    mask = (keys <= queries) & (keys > queries - window)
    mx.eval(mask)
    return mask
