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
from functools import cache

import mlx.core as mx

_compiling = threading.local()


@contextmanager
def compiling() -> Iterator[None]:
    """This thread calls a function compiled with ``mx.compile`` (whose first call in a
    thread traces it): an array made and evaluated meanwhile is a constant every call
    reuses; one left lazy is an operation every call runs again, and MLX's compile merges
    equal ones."""
    depth = getattr(_compiling, "depth", 0)
    _compiling.depth = depth + 1
    try:
        yield
    finally:
        _compiling.depth = depth


def in_compiled() -> bool:
    """Whether this thread is inside :func:`compiling`."""
    return getattr(_compiling, "depth", 0) > 0


#: the fewest bytes a constant's buffer holds (see :func:`constant`)
MIN_CONSTANT_BYTES = 16


@cache
def constant(values: tuple[int | float | bool, ...], dtype: mx.Dtype) -> mx.array:
    """``mx.array(values, dtype)``, made and evaluated once per (values, dtype).

    Its buffer holds at least :data:`MIN_CONSTANT_BYTES` (the array is a view of the first
    entries): MLX on CUDA serves arrays of at most 8 bytes from one pool of managed memory
    whose pages the host writes every step (a step's offset), so a kernel reading a small
    constant there may read across the bus; a larger buffer is an allocation of its own,
    which moves to the GPU at its first use and stays."""
    padding = max(0, -(-MIN_CONSTANT_BYTES // dtype.size) - len(values))
    array = mx.array(values + (0,) * padding, dtype=dtype)
    if padding:
        array = array[:len(values)]
    mx.eval(array)
    return array


def off_scalar_pool(a: mx.array) -> mx.array:
    """``a``, where it holds at most 8 bytes on MLX's CUDA backend, copied by one kernel
    into a buffer of :data:`MIN_CONSTANT_BYTES` (a view of its first entries): one kernel
    reads ``a`` where MLX keeps it, in its managed scalar pool (see :func:`constant`), the
    kernels after it read the GPU's own memory. Elsewhere ``a`` itself."""
    short = -(-MIN_CONSTANT_BYTES // a.dtype.size) - a.size
    cuda = getattr(mx, "cuda", None)
    if a.nbytes > 8 or short <= 0 or cuda is None or not cuda.is_available() \
            or mx.default_device() != mx.gpu:
        return a
    flat = mx.concatenate([a.reshape(-1), constant((0,) * short, a.dtype)])
    return flat[:a.size].reshape(a.shape)


@cache
def arange_constant(n: int) -> mx.array:
    """``mx.arange(n)`` (int32), made and evaluated once per ``n``."""
    array = mx.arange(n, dtype=mx.int32)
    mx.eval(array)
    return array
