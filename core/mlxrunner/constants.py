"""Arrays a traced function holds as constants.

Inside a traced (``mx.compile``) function, ``mx.arange(n)`` or ``mx.array([...])`` is an
operation replayed on every call. These make the array once per value, evaluated, so a
trace holds it as a constant, and a kernel input made this way is not copied from the host
on every launch.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx


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
