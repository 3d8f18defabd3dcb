"""Constants a trace holds, and small arrays moved out of MLX's managed scalar pool."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxrunner.constants import constant, off_scalar_pool


def _on_cuda() -> bool:
    cuda = getattr(mx, "cuda", None)
    return mx.default_device() == mx.gpu and cuda is not None and cuda.is_available()


@pytest.mark.parametrize(("values", "dtype"), [
    ((1e-6,), mx.float32), ((True,), mx.bool_), ((3, 4, 5), mx.int32),
    ((0.5,), mx.bfloat16), (tuple(range(6)), mx.float32)])
def test_constant_holds_its_values_alone(values: tuple, dtype: mx.Dtype) -> None:
    # a padded buffer is a view of the first entries: nothing of the padding shows
    made = constant(values, dtype)
    assert made.shape == (len(values),) and made.dtype == dtype
    assert made.tolist() == mx.array(values, dtype=dtype).tolist()
    assert constant(values, dtype) is made  # made once per (values, dtype)
    assert (made * 2).tolist() == (mx.array(values, dtype=dtype) * 2).tolist()


@pytest.mark.parametrize(("a", "small"), [
    (mx.array(7, mx.int32), True), (mx.array([2.5], mx.bfloat16), True),
    (mx.array([1, 2], mx.int32), True), (mx.array([1, 2, 3], mx.int32), False),
    (mx.zeros((4, 4)), False)])
def test_off_scalar_pool_keeps_values(a: mx.array, small: bool) -> None:
    moved = off_scalar_pool(a)
    assert moved.shape == a.shape and moved.dtype == a.dtype
    assert moved.tolist() == a.tolist()
    # a copy only where MLX's CUDA backend pools the array (at most 8 bytes)
    assert (moved is not a) == (small and _on_cuda())


@pytest.mark.skipif(not _on_cuda(), reason="MLX's managed scalar pool is on CUDA only")
def test_a_kernel_reads_moved_scalars() -> None:
    x = mx.arange(8, dtype=mx.float32)
    scale = off_scalar_pool(mx.array([3.0], mx.float32))
    offset = off_scalar_pool(mx.array(5, mx.int32))
    assert ((x * scale + offset)).tolist() == [3.0 * i + 5 for i in range(8)]
