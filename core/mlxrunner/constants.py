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


@cache
def constant(values: tuple[int | float | bool, ...], dtype: mx.Dtype) -> mx.array:
    """``mx.array(values, dtype)``, made and evaluated once per (values, dtype)."""
    array = mx.array(values, dtype=dtype)
    mx.eval(array)
    return array


@cache
def arange_constant(n: int) -> mx.array:
    """``mx.arange(n)`` (int32), made and evaluated once per ``n``."""
    array = mx.arange(n, dtype=mx.int32)
    mx.eval(array)
    return array
